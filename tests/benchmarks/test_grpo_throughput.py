"""benchmarks/grpo_throughput.py: its figures from hand-made step times, the model it builds (whose EOS, pad and
unk can never be sampled, so both frameworks generate every token asked), and its --dry-run, which runs ember's
GRPO and TRL's GRPOTrainer end to end at a tiny size on this CPU and must write the whole JSON."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
bench = load_benchmark("grpo_throughput")


def test_a_row_is_the_median_over_rounds_of_each_rounds_kept_steps():
    spec = {"batch": 4, "new_tokens": 8, "warmup": 1}
    same = {"framework": "ember", "version": "0.1.0", "prompt_tokens": [8]}
    runs = [same | {"step_s": [9.0, 1, 2, 3], "rollout_s": [5.0, 0.5, 0.5, 1.5], "generate_s": [5.0, 0.4, 0.4, 0.4],
                    "update_s": [1.0, 0.2, 0.2, 0.2], "full_length": True},
            same | {"step_s": [9.0, 4, 4, 4], "rollout_s": [5.0, 1.0, 1.0, 1.0], "generate_s": [5.0, 0.6, 0.6, 0.6],
                    "update_s": [1.0, 0.4, 0.4, 0.4], "full_length": False}]
    row = bench.summarize(runs, spec)
    assert row["step_s"] == 3.0 and row["rollout_s"] == 0.75 and row["generate_s"] == 0.5  # medians of 2, 4 ...
    assert row["rest_s"] == 2.25 and row["update_s"] == pytest.approx(0.3)
    assert row["rollout_tokens_per_s"] == 32 / 0.75 and row["generate_tokens_per_s"] == 64
    assert row["steps_timed"] == 6 and row["step_spread"] == 4.0 and row["full_length"] is False


@pytest.mark.slow
def test_the_model_cannot_sample_its_special_tokens(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = argparse.Namespace(shape="tiny", seed=0, prompt_len=8, new_tokens=8, batch=4, group_size=2, steps=3)
    hf, prompts = bench.build_inputs(tmp_path, args)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert (tokenizer.unk_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    assert len(rows) == 8 and all(len(tokenizer(r)["input_ids"]) == 8 for r in rows)
    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        tokens = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(0))
        probs = torch.softmax(model(tokens).logits, dim=-1)
    assert probs[..., :3].max().item() == 0.0 and probs[..., 3:].min().item() > 0


@pytest.mark.slow
def test_the_dry_run_writes_both_frameworks_figures_and_their_ratios(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/grpo_throughput.py", "--dry-run", "--threads", "1", "--out",
                           str(tmp_path), "--note", "a test"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["grpo_throughput-dryrun-cpu.json"]
    result = json.loads((tmp_path / "grpo_throughput-dryrun-cpu.json").read_text())
    assert result["benchmark"] == "grpo_throughput-dryrun" and result["dry_run"] is True
    assert result["date"] and result["machine"] and result["torch"] and result["trl"] and result["transformers"]
    assert result["config"]["threads"] == 1 and result["config"]["precision"] == "fp32"
    assert result["notes"].startswith("a test")
    rows = {row["framework"]: row for row in result["rows"]}
    assert list(rows) == ["ember", "trl"]
    for row in rows.values():
        assert row["full_length"] is True and row["prompt_tokens"] == [8] and row["completion_tokens_per_step"] == 32
        assert row["steps_timed"] == 2 and [len(steps) for steps in row["step_s_all"]] == [3]
        assert row["step_s"] > 0 and row["rollout_s"] > 0 and row["generate_s"] > 0 and row["step_spread"] >= 1
        assert row["rollout_tokens_per_s"] == pytest.approx(32 / row["rollout_s"])
        assert row["generate_tokens_per_s"] == pytest.approx(32 / row["generate_s"])
    assert rows["ember"]["update_s"] > 0
    ratios = result["ratios"]
    assert ratios["rollout_tokens_per_s"] == pytest.approx(rows["ember"]["rollout_tokens_per_s"]
                                                           / rows["trl"]["rollout_tokens_per_s"])
    assert ratios["step_speedup"] == pytest.approx(rows["trl"]["step_s"] / rows["ember"]["step_s"])
    assert ratios["step_time_ratio"] == pytest.approx(1 / ratios["step_speedup"])
    assert result["targets"] == {"rollout_tokens_per_s": 1.5, "step_speedup": 1.3}
    assert result["met"] == {key: ratios[key] >= target for key, target in result["targets"].items()}
    decode = result["decode"]
    assert decode["batch"] == 4 and decode["new_tokens"] == 8 and decode["prefill_tokens_per_s"] > 0
    assert decode["decode_tokens_per_s"] is None or decode["decode_tokens_per_s"] > 0  # None: a prefill outlasted all
    assert isinstance(result["shared_machine"], bool) and result["other_processes_cores"] >= 0
    assert "ember/TRL rollout tokens/s" in done.stdout
