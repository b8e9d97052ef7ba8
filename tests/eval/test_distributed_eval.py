"""Distributed eval (`ember eval --nproc-per-node 2 ... ici_mesh.fsdp=2 | ici_mesh.tensor=2`) gives the results of
one process: the built-in tasks through the CLI, and the lm-eval adapter's three request types through a worker."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_records, run_ember, tiny_model

# Every test here trains in a subprocess and evaluates on two processes.
pytestmark = pytest.mark.slow

WORDS = "import os sys def main self return None if x for in range print class".split()


OFFLINE = {**os.environ, "HF_DATASETS_OFFLINE": "1"}


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny trained run (4 heads, 2 KV heads: tensor=2 splits both) and task files whose row counts leave
    the two data ranks uneven shares of batches (the idle-forward path)."""
    root = tmp_path_factory.mktemp("dist-eval")
    proc = run_ember("train", "debug", *tiny_model(2), "seq_len=32", "global_batch_size=4", "micro_batch_size=4",
                     "max_steps=20", "metrics.console=false", "eval_batches=1", f"output_dir={root / 'run'}",
                     env=OFFLINE)
    assert proc.returncode == 0, proc.stderr
    rng = random.Random(0)
    rows = {"lambada": [{"text": _text(rng, 4, 40)} for _ in range(9)],
            "boolq": [{"passage": _text(rng, 4, 30), "question": "is it python", "answer": i % 2 == 0}
                      for i in range(7)],
            "choice": [{"context": _text(rng, 3, 20), "choices": [_text(rng, 1, 3) for _ in range(3)], "label": i % 3}
                       for i in range(5)]}
    for task, task_rows in rows.items():
        (root / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task_rows))
    return root


def _eval(run: Path, name: str, *extra: str) -> dict:
    tasks = [f"{t}={run / f'{t}.jsonl'}" for t in ("lambada", "boolq", "choice")]
    proc = run_ember("eval", *extra, str(run / "run"), "ppl", *tasks, "eval.max_tokens=700", "eval.batch_size=4",
                     "eval.seq_len=32", "--output", str(run / name), env=OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run / name).read_text())["results"]


@pytest.mark.parametrize("axis", ["fsdp", "tensor"])
def test_distributed_tasks_equal_one_process(run: Path, axis: str):
    single = _eval(run, "single.json")
    sharded = _eval(run, f"{axis}.json", "--nproc-per-node", "2", f"ici_mesh.{axis}=2")
    assert single.keys() == sharded.keys() == {"ppl", "lambada", "boolq", "choice"}
    assert single["ppl"]["tokens"] == sharded["ppl"]["tokens"] == 700
    for task, metrics in single.items():
        for name, value in metrics.items():
            if name in ("acc", "acc_norm", "n", "tokens", "data", "split"):
                assert sharded[task][name] == value, (task, name)
            else:
                assert sharded[task][name] == pytest.approx(value, rel=1e-5), (task, name)


@pytest.mark.parametrize("axis", ["fsdp", "tensor"])
def test_the_lm_eval_adapter_on_a_mesh_equals_one_process(run: Path, axis: str):
    from ember.eval.harness import EmberLM
    from ember.generate import tokenizer_for
    from ember.model_io.load import load_model

    rng = random.Random(1)
    requests = {"loglikelihood": [(_text(rng, 3, 40), " " + rng.choice(WORDS)) for _ in range(7)],
                "rolling": [_text(rng, 20, 90) for _ in range(3)],  # longer than the 32-token context: several windows
                "generate": [_text(rng, 2, 8) for _ in range(3)]}
    (run / "requests.json").write_text(json.dumps(requests))

    class Request:
        def __init__(self, args: tuple) -> None:
            self.args = args

    lm = EmberLM(load_model(run / "run"), tokenizer_for(str(run / "run"), None), batch_size=2)
    single = {"loglikelihood": lm.loglikelihood([Request(tuple(r)) for r in requests["loglikelihood"]]),
              "rolling": lm.loglikelihood_rolling([Request((t,)) for t in requests["rolling"]]),
              "generate": lm.generate_until([Request((p, {"until": ["\n\n"], "max_gen_toks": 6}))
                                             for p in requests["generate"]])}
    out = run / f"adapter-{axis}.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("distributed_worker.py")), str(out), str(run / "requests.json"),
                           str(run / "run"), f"ici_mesh.{axis}=2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads(out.read_text())
    for (a, greedy_a), (b, greedy_b) in zip(single["loglikelihood"], sharded["loglikelihood"]):
        assert b == pytest.approx(a, abs=1e-4) and greedy_a == greedy_b
    assert sharded["rolling"] == pytest.approx(single["rolling"], abs=1e-3)
    assert sharded["generate"] == single["generate"]


def test_mesh_mistakes_are_one_line_before_any_process_starts(run: Path):
    for extra, message in [(["ici_mesh.tensor=3"], "world size 2 is not divisible"),
                           (["ici_mesh.pipeline=2"], "ember eval shards the model over data, fsdp, tensor"),
                           (["ici_mesh.fsdp=two"], "ici_mesh.fsdp must be int, got 'two'")]:
        proc = run_ember("eval", "--nproc-per-node", "2", str(run / "run"), "ppl", *extra, timeout=60, env=OFFLINE)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, (extra, proc.stderr)
    proc = run_ember("eval", "--nproc", "2", str(run / "run"), "ppl", timeout=60, env=OFFLINE)
    assert proc.returncode == 2 and "unknown option '--nproc' for ember eval" in proc.stderr


def test_in_loop_eval_on_two_fsdp_ranks_equals_ember_eval(run: Path, tmp_path: Path):
    """eval.tasks under `ember train --nproc-per-node 2` (fsdp=2): each rank scores half of the requests, and the
    logged numbers equal `ember eval` of the final checkpoint on one process."""
    lam, bq = run / "lambada.jsonl", run / "boolq.jsonl"
    out = tmp_path / "run"
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *tiny_model(), "seq_len=32", "global_batch_size=4",
                     "micro_batch_size=2", "max_steps=3", "metrics.console=false", "eval_batches=1",
                     "eval.batch_size=2", f"output_dir={out}",
                     f"eval.tasks=[{{name: lambada, data: {lam}}}, {{name: boolq, data: {bq}}}]", env=OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [r for r in read_records(out) if "eval/lambada/acc" in r][-1]
    proc = run_ember("eval", str(out), f"lambada={lam}", f"boolq={bq}", "--output", str(tmp_path / "e.json"),
                     env=OFFLINE)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "e.json").read_text())["results"]
    assert final["eval/lambada/n"] == 9 and final["eval/boolq/n"] == 7
    assert final["eval/lambada/perplexity"] == pytest.approx(results["lambada"]["perplexity"], rel=1e-5)
    assert final["eval/lambada/acc"] == results["lambada"]["acc"] and final["eval/boolq/acc"] == results["boolq"]["acc"]
