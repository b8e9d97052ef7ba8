"""The lm-evaluation-harness adapter: the same log-likelihoods as lm-eval's own `hf` model on the HF export
of the same weights, and a local task run offline through `ember eval --harness`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from ember.data.tokenizer import embedded_tokenizer
from ember.eval.harness import EmberLM
from ember.model_io.convert import convert, save_hf
from ember.models import MODELS, build_model_args
from tests.helpers import TINY_RUN, run_ember


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """(ember model, its tokenizer, lm-eval's HFLM on the HF export of the same weights and tokenizer)."""
    import transformers

    tokenizer = embedded_tokenizer(512, 0.02)
    args = build_model_args("llama3", "debug", {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
                                                "vocab_size": 512, "max_seq_len": 64})
    torch.manual_seed(0)
    model = MODELS["llama3"].model_cls(args)
    model.init_weights()
    model.eval()
    out = tmp_path_factory.mktemp("harness") / "hf"
    save_hf(model, args, out)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok, eos_token="<|end_of_text|>")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    return model, tokenizer, HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=4, max_length=64)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_lm_evals_hf_model(pair):
    model, tokenizer, hflm = pair
    requests = _requests("loglikelihood", [("def main(self):", " return"), ("import os ", "sys"),
                                           ("x = 1\n" * 40, "y = 2"), ("The cat", " sat on the mat"),
                                           ("", " import os"), ("", "x")])  # empty: after EOS (no BOS declared)
    ours = EmberLM(model, tokenizer, batch_size=3).loglikelihood(requests)
    theirs = hflm.loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    texts = _requests("loglikelihood_rolling", [("for i in range(10):\n    print(i)\n" * 6,), ("short text",)])
    for a, b in zip(EmberLM(model, tokenizer).loglikelihood_rolling(texts), hflm.loglikelihood_rolling(texts)):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_a_local_task_runs_offline_through_the_cli(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=2", f"output_dir={run}")
    assert proc.returncode == 0, proc.stderr
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"q": f"import os{i}", "a": " sys"}) + "\n" for i in range(6)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(
        f"task: ember_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    proc = run_ember("eval", str(run), "--harness", "ember_tiny", "--include-path", str(tasks), "--output",
                     str(tmp_path / "e.json"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "e.json").read_text())["results"]["ember_tiny"]
    # lm-eval's own `hf` model on the HF export of the same run (its weights and tokenizer), the same task
    convert(run, tmp_path / "hf", to="hf")
    hflm = HFLM(pretrained=str(tmp_path / "hf"), batch_size=4, device="cpu")
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=["ember_tiny"],
                                     task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    theirs = theirs["results"]["ember_tiny"]
    assert results["perplexity"] == pytest.approx(theirs["perplexity,none"], rel=1e-4)
    assert results["acc"] == theirs["acc,none"]
    assert results["data"] == f"lm-eval --include-path {tasks}"


def test_a_task_lm_eval_does_not_know_is_one_line_before_the_model_loads(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture):
    """(There is no model at the path: the names are checked first.)"""
    from ember import cli

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text("task: ember_tiny\ndataset_path: json\noutput_type: loglikelihood\n")
    for name, hint in (("nosuch_task", ""), ("ember_tyni", " (did you mean 'ember_tiny'?)")):
        argv = ["eval", str(tmp_path / "run"), "--harness", name, "--include-path", str(tasks), "--limit", "2"]
        assert cli.main(argv) == 2
        assert capsys.readouterr() == ("", f"error: lm-eval task '{name}' is not defined in --include-path {tasks}"
                                           f"{hint}; give a task name one of its YAMLs defines (task: NAME), or drop "
                                           "--include-path for lm-eval's registered tasks\n")


@pytest.mark.slow
def test_a_mistyped_registered_task_is_one_line_naming_the_close_one(tmp_path: Path, capsys: pytest.CaptureFixture):
    from ember import cli

    assert cli.main(["eval", str(tmp_path / "run"), "--harness", "lambada_opnai", "--limit", "2"]) == 2
    assert capsys.readouterr() == ("", "error: 'lambada_opnai' is not an lm-eval task "
                                       "(did you mean 'lambada_openai'?); "
                                       "give a registered task name (`lm-eval ls tasks` lists them), or --include-path "
                                       "DIR with a folder of task YAMLs that defines it\n")
