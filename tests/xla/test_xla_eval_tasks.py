"""In-loop eval.tasks on the XLA engine: scored by the compiled logits function over the sharded weights (fsdp x
tensor, a layout the torch engine refuses for eval.tasks), they equal the torch engine's on one process."""

from pathlib import Path

import pytest

from tests.helpers import TINY_RUN, read_records, run_ember, write_jsonl

pytestmark = pytest.mark.slow


def test_in_loop_eval_tasks_on_xla_equal_the_torch_engines(tmp_path: Path, xla_env: dict):
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": "import os and sys"}, {"text": "def main ( self"},
                                             {"text": "return None if x"}, {"text": "for key in range"}])
    bq = write_jsonl(tmp_path / "b.jsonl", [{"passage": "import os", "question": "is it python", "answer": True},
                                            {"passage": "a b c", "question": "is it python", "answer": False},
                                            {"passage": "def f(): pass", "question": "is it code", "answer": True}])
    common = ["debug", *TINY_RUN, "global_batch_size=8", "max_steps=4", "eval_interval=2", "logging_steps=1",
              "precision=fp32", "eval.batch_size=2",
              f"eval.tasks=[{{name: lambada, data: {lam}}}, {{name: boolq, data: {bq}}}]"]
    run_ember("train", *common, "micro_batch_size=8", f"output_dir={tmp_path / 'torch'}", expect=0)
    run_ember("train", *common, "device=xla", "ici_mesh.fsdp=4", "ici_mesh.tensor=2", "micro_batch_size=2",
              f"output_dir={tmp_path / 'xla'}", env=xla_env, expect=0)

    def evals(run: Path) -> dict[int, dict]:
        return {r["step"]: r for r in read_records(run) if "eval/lambada/acc" in r}

    torch_evals, xla_evals = evals(tmp_path / "torch"), evals(tmp_path / "xla")
    assert sorted(torch_evals) == sorted(xla_evals) == [2, 4]
    for step, expected in torch_evals.items():
        got = xla_evals[step]
        assert got["eval/lambada/n"] == 4 and got["eval/boolq/n"] == 3
        for key in ("eval/lambada/acc", "eval/boolq/acc"):
            assert got[key] == expected[key], (step, key)
        # the same weights to fp32 summation order (the two engines' losses agree to ~1e-7 relative)
        assert got["eval/lambada/perplexity"] == pytest.approx(expected["eval/lambada/perplexity"], rel=1e-4)
        assert got["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
