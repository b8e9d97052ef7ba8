"""Every parallel layout trains exactly like one process: for each layout the losses and gradient norms
of the first steps equal the single-process run on the same global batch.

The layouts of one world size run in a single torchrun job that shares one process group
(layouts_worker.py), on CPU with gloo. Tolerances: tests.helpers.assert_trains_like; what differs is only the
order of floating-point sums (reduce-scatters, sharded matmuls, the all-gathered attention), and what Adam's
first updates make of it.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember import load_model
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import EXACT_REL, assert_trains_like, job_env, read_records, run_ember, run_layouts, tiny_model

STEPS = 3
LR = 1e-2
# A small Llama 3 that every layout here can split: 4 layers (4 pipeline stages), 4 query / 2 K/V
# heads (tensor=2), seq 32 (context=2 makes 4 chunks). lr is high enough that steps 2-3 move.
BASE = [
    "data.dataset=synthetic", *tiny_model(4),
    "model.vocab_size=512", "seq_len=32", "global_batch_size=8", f"max_steps={STEPS}", "logging_steps=1",
    "eval_batches=1", "schedule.warmup_steps=0", f"optim.lr={LR}",
]

WORLD2 = {
    "fsdp=2": ["micro_batch_size=4"],
    "data=2 (replicate)": ["micro_batch_size=4", "ici_mesh.data=2", "ici_mesh.fsdp=1"],
    "tensor=2 + loss parallel": ["micro_batch_size=4", "ici_mesh.tensor=2"],
    "tensor=2, replicated logits": ["micro_batch_size=4", "ici_mesh.tensor=2", "parallel.loss_parallel=false"],
    "pipeline=2 gpipe": ["micro_batch_size=4", "ici_mesh.pipeline=2", "parallel.pp_schedule=gpipe"],
    "pipeline=2 1f1b": ["micro_batch_size=4", "ici_mesh.pipeline=2", "parallel.pp_schedule=1f1b"],
    "pipeline=2 interleaved_1f1b": ["micro_batch_size=4", "ici_mesh.pipeline=2",
                                    "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
    "context=2 (all-gather K/V)": ["micro_batch_size=4", "ici_mesh.context=2"],
    "fsdp=2 remat=full": ["micro_batch_size=4", "model.remat=full"],
    "fsdp=2 remat=selective": ["micro_batch_size=4", "model.remat=selective", "model.remat_every=2"],
    "fsdp=2 remat=op": ["micro_batch_size=4", "model.remat=op"],
    "fsdp=2 remat=offload": ["micro_batch_size=4", "model.remat=offload"],
    "fsdp=2 no reshard after forward": ["micro_batch_size=4", "parallel.reshard_after_forward=false"],
    "tensor=2 compiled": ["micro_batch_size=4", "ici_mesh.tensor=2", "compile=true"],
    # Llama 3.2 ties the output projection to the embedding: the tie must survive sharding.
    "tied, fsdp=2": ["micro_batch_size=4", "model.family=llama3.2"],
    "tied, tensor=2": ["micro_batch_size=4", "model.family=llama3.2", "ici_mesh.tensor=2"],
}
TIED = "model.family=llama3.2"
WORLD4 = {
    "data=2 x fsdp=2 (HSDP)": ["micro_batch_size=2", "ici_mesh.data=2", "ici_mesh.fsdp=2"],
    "fsdp=2 x tensor=2": ["micro_batch_size=4", "ici_mesh.fsdp=2", "ici_mesh.tensor=2"],
    "pipeline=2 x fsdp=2": ["micro_batch_size=4", "ici_mesh.pipeline=2", "ici_mesh.fsdp=2"],
    "context=2 x fsdp=2 remat=full": ["micro_batch_size=4", "ici_mesh.context=2", "ici_mesh.fsdp=2",
                                      "model.remat=full"],
    "tensor=2 x context=2": ["micro_batch_size=4", "ici_mesh.tensor=2", "ici_mesh.context=2", "ici_mesh.fsdp=1"],
    "dcn fsdp=2 x ici tensor=2, compiled": ["micro_batch_size=4", "dcn_mesh.fsdp=2", "ici_mesh.fsdp=1",
                                            "ici_mesh.tensor=2", "compile=true"],
}


def _single_process(out: Path, *overrides: str) -> dict:
    cfg = run_lib.load_config("debug", BASE + ["micro_batch_size=8", f"output_dir={out}", "metrics.console=false",
                                               *overrides])
    summary = Trainer(cfg).train()
    steps = [r for r in read_records(out) if "loss" in r]
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "val_loss": summary["val_loss"], "dir": out}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory.mktemp("tied"), TIED)


def _assert_matches(results: dict, reference: dict, tied_reference: dict | None = None, cases: dict = WORLD2) -> None:
    assert len(reference["loss"]) == STEPS
    for name, got in results.items():
        expected = tied_reference if TIED in cases.get(name, []) else reference
        assert expected is not None, name
        assert_trains_like(got, expected, LR, name)  # every layout evaluates the same validation samples too


@pytest.mark.slow
def test_world_size_2_layouts_match_single_process(reference, tied_reference, tmp_path):
    results = run_layouts(tmp_path, 2, WORLD2, BASE)
    assert set(results) == set(WORLD2)
    # The loss moves over the steps, so agreement is not the trivial agreement of an untrained model.
    assert reference["loss"][0] - reference["loss"][-1] > 1e-3
    assert tied_reference["loss"] != pytest.approx(reference["loss"], rel=1e-3)
    _assert_matches(results, reference, tied_reference, WORLD2)
    # The final checkpoint, written by all ranks from their shards or stages (DCP), loads on one process
    # as the weights the single-process run ended with. Adam's first steps move each weight by about
    # lr = 1e-2 whatever its gradient's size, so fp32 summation noise in near-zero gradients shows as
    # up to ~2e-5 here; a misplaced shard would be off by the weights' own size (~0.05).
    expected = load_model(reference["dir"]).state_dict()
    for name in ("tensor=2 + loss parallel", "pipeline=2 interleaved_1f1b", "fsdp=2"):
        got = load_model(tmp_path / "results.json.runs" / name).state_dict()
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-4, msg=f"{name}: {key}")


@pytest.mark.slow
def test_world_size_4_layouts_match_single_process(reference, tmp_path):
    results = run_layouts(tmp_path, 4, WORLD4, BASE)
    assert set(results) == set(WORLD4)
    _assert_matches(results, reference, None, WORLD4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, nproc", [("dcn_mesh.data=2", 1), ("dcn_mesh.fsdp=2", 2)])
def test_two_nodes_on_loopback(reference, tmp_path, mesh, nproc):
    """Two launchers with c10d rendezvous on 127.0.0.1, as two nodes would run: `ember train --nnodes 2`."""
    port = _free_port()
    out = tmp_path / "run"
    extra = [mesh, "micro_batch_size=4" if nproc == 1 else "micro_batch_size=2", f"output_dir={out}",
             "metrics.console=false"]
    if nproc == 2:
        extra += ["ici_mesh.fsdp=1", "ici_mesh.data=2"]  # node-local replicas, FSDP across the two nodes
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ember", "train", f"--nproc-per-node={nproc}", "--nnodes=2", f"--node-rank={node}",
             f"--rdzv-endpoint=127.0.0.1:{port}", "debug", *BASE, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(),
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    losses = [r["loss"] for r in read_records(out) if "loss" in r]
    assert losses == pytest.approx(reference["loss"], rel=EXACT_REL)


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_and_names_itself(tmp_path):
    """Rank 1 raises at its second step while rank 0 waits in a collective: the launcher must stop the
    job (no hang), exit non-zero, and the console must show which rank failed and why."""
    inject = tmp_path / "inject"
    inject.mkdir()
    # sitecustomize runs at interpreter start in every rank; it breaks rank 1 only.
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import ember.train.trainer as t\n"
        "    original = t.Trainer.train_step\n"
        "    def failing(self, batches):\n"
        "        if self.step == 1:\n"
        "            raise RuntimeError('injected failure')\n"
        "        return original(self, batches)\n"
        "    t.Trainer.train_step = failing\n"
    )
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(inject), env.get("PYTHONPATH", "")])
    # No hang: the job ends because rank 1 failed, not at the collectives' timeout (an hour here), well inside
    # the subprocess ceiling, which only bounds a hang on a loaded machine.
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *BASE, "micro_batch_size=4", "max_steps=20",
                     "parallel.timeout_s=3600", f"output_dir={tmp_path / 'run'}", "metrics.console=false", env=env)
    assert proc.returncode != 0
    assert "error: [rank 1] RuntimeError: injected failure" in proc.stderr
    assert "the job failed on rank 1" in proc.stderr


@pytest.mark.slow
def test_launch_flags_are_checked_before_any_process_starts(tmp_path):
    proc = run_ember("train", "--nproc-per-node", "3", "debug", "data.dataset=synthetic", "ici_mesh.tensor=2",
                     env=job_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the world size 3 is not divisible by the product of the other mesh axes (2), so ici_mesh.fsdp=-1 "
        "cannot fill it; change the degrees or the number of processes"
    ]
    proc = run_ember("train", "--nnodes", "2", "debug", env=job_env())
    assert proc.returncode == 2 and "--nnodes > 1 needs --rdzv-endpoint" in proc.stderr
