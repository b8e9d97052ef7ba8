"""docs/rl.md's SFT-to-GRPO commands run as the page writes them (benchmarks/grpo_arithmetic.py --tiny: a few steps
of each training run), end to end: the data, both runs and both held-out evaluations, into the results JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import job_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_pages_sft_to_grpo_commands_run_and_record_both_accuracies(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_arithmetic.py"), "--tiny", "--work",
                           str(tmp_path / "work"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          env=job_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "grpo_arithmetic-tiny-cpu.json").read_text())
    commands = [c["command"] for c in result["commands"]]
    assert [c.split()[1] for c in commands] == ["data", "data", "data", "train", "eval", "train", "eval"]
    assert [row["model"] for row in result["rows"]] == ["SFT", "GRPO"]
    assert all(0 <= row["heldout_exact"] <= 1 and row["heldout_rows"] == 200 for row in result["rows"])
    assert [step for step, _ in result["reward_curve"]] == [1, 2]
    heldout = (tmp_path / "work" / "arith" / "heldout.jsonl").read_text().splitlines()
    train = {json.loads(line)["prompt"] for line in (tmp_path / "work" / "arith" / "train.jsonl").open()}
    assert len(heldout) == 200 and not train & {json.loads(line)["prompt"] for line in heldout}
    assert (tmp_path / "out" / "rl-arithmetic.png").stat().st_size > 0
