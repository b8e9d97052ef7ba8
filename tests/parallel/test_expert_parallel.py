"""Expert parallelism trains exactly like one process: Mixtral's experts sharded over the expert axis
(tokens exchanged by all-to-all), alone and with FSDP, HSDP, tensor and context parallelism (the MoE
layers on each rank's own sequence shard), give the single-process losses, grad norms and per-expert
loads of the first steps; the checkpoints load on one process as the same weights.

Tolerances: tests.helpers.assert_trains_like (only the order of fp32 sums differs, and what Adam's first updates
make of it). The router losses are off
here: like every data-parallel layout, expert ranks compute the load-balancing statistics over their
own tokens (as MaxText and Megatron-LM do by default), which is a different loss from one process's.
"""


import pytest
import torch

from ember import load_model
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import assert_trains_like, read_records, run_layouts, tiny_model

# Every test here runs torchrun jobs.
pytestmark = pytest.mark.slow

STEPS = 3
LR = 1e-2
MOE = [
    "model.family=mixtral", "model.flavor=debug", "data.dataset=synthetic", *tiny_model(2), "model.vocab_size=512",
    "model.ffn_hidden_dim=96", "model.n_experts=4", "model.top_k=2", "model.aux_loss_coef=0", "model.z_loss_coef=0",
    "seq_len=32", "global_batch_size=8", f"max_steps={STEPS}", "logging_steps=1", "eval_batches=1",
    "schedule.warmup_steps=0", f"optim.lr={LR}",
]
CASES = {
    2: {"expert=2": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.expert=2"],
        # attention and norms compiled, the MoE (host-side split sizes) eager
        "expert=2 compiled": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.expert=2", "compile=true"],
        # attention tensor-parallel, the MoE on each tensor rank's sequence shard, its weights reduced over tensor
        "tensor=2": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.tensor=2"],
        "context=2": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.context=2"]},
    4: {
        "fsdp=2 x expert=2": ["micro_batch_size=2", "ici_mesh.fsdp=2", "ici_mesh.expert=2"],
        "data=2 x expert=2 (replicated experts)": ["micro_batch_size=2", "ici_mesh.fsdp=1", "ici_mesh.data=2",
                                                   "ici_mesh.expert=2"],
        "expert=4, remat=full": ["micro_batch_size=2", "ici_mesh.fsdp=1", "ici_mesh.expert=4", "model.remat=full"],
        # experts on a (tensor, expert) mesh: sharded over expert, their gradients reduced over tensor
        "expert=2 x tensor=2": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.expert=2", "ici_mesh.tensor=2"],
        "fsdp=2 x tensor=2": ["micro_batch_size=4", "ici_mesh.fsdp=2", "ici_mesh.tensor=2"],
        "expert=2 x context=2": ["micro_batch_size=4", "ici_mesh.fsdp=1", "ici_mesh.expert=2", "ici_mesh.context=2"],
    },
}


# GLaM: dense and MoE layers alternate (layer 0 is MoE), two-matrix experts, tied embeddings.
GLAM = [item for item in MOE if not item.startswith(("model.family", "model.flavor", "model.n_kv_heads"))] + [
    "model.family=glam", "model.flavor=debug"]


def _single_process(out, base: list[str]) -> dict:
    cfg = run_lib.load_config("debug", base + ["micro_batch_size=8", f"output_dir={out}", "metrics.console=false"])
    summary = Trainer(cfg).train()
    steps = [r for r in read_records(out) if "loss" in r]
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "expert_load": [r["moe/layer0/tokens_per_expert"] for r in steps], "val_loss": summary["val_loss"],
            "dir": out}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _single_process(tmp_path_factory.mktemp("moe-reference"), MOE)


def test_glam_expert_and_tensor_parallel_match_single_process(tmp_path):
    expected = _single_process(tmp_path / "reference", GLAM)
    # tensor=2: GLaM's dense layers column/row-split, its MoE layers sequence-sharded, its tied matrix whole
    cases = {"glam expert=2": CASES[2]["expert=2"], "glam tensor=2": CASES[2]["tensor=2"]}
    results = run_layouts(tmp_path, 2, cases, GLAM)
    for name, got in results.items():
        assert_trains_like({**got, "val_loss": None}, expected, LR, name)
        assert got["expert_load"][0] == expected["expert_load"][0], name


def test_router_losses_under_pipeline_and_tensor_parallelism(tmp_path):
    """Router losses on. Each MoE layer adds them to the gradient where it runs (a pipeline stage needs
    nothing from the last), weighted by the share of the step's tokens it routed. Pipeline stages see
    the whole micro-batch (one pipeline micro-batch here), so they equal one process exactly, with
    activation checkpointing too (its recomputed forwards add no second loss and no second load).
    Tensor ranks compute the statistics over their own sequence shard, each weighted 1/tp: close to one
    process (measured rel ~1e-3 on the grad norm), while counting every shard at full weight is ~3e-2 off."""
    losses = ["model.aux_loss_coef=1.0", "model.z_loss_coef=0.1"]
    expected = _single_process(tmp_path / "reference", MOE + losses)
    without = _single_process(tmp_path / "no-router-losses", MOE)
    assert expected["grad_norm"][0] - without["grad_norm"][0] > 3e-3  # the router losses move the gradients
    pipeline = ["micro_batch_size=8", "ici_mesh.fsdp=1", "ici_mesh.pipeline=2", "parallel.pp_schedule=gpipe",
                "parallel.pp_microbatches=1"]
    cases = {"pipeline=2": pipeline, "pipeline=2 remat=full": pipeline + ["model.remat=full"],
             "tensor=2": CASES[2]["tensor=2"]}
    results = run_layouts(tmp_path, 2, cases, MOE + losses)
    for name in ("pipeline=2", "pipeline=2 remat=full"):
        assert_trains_like({**results[name], "val_loss": None}, expected, LR, name)
        assert results[name]["expert_load"] == expected["expert_load"], name
    assert results["tensor=2"]["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    assert results["tensor=2"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=3e-3)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layouts_match_single_process(reference, tmp_path, world):
    results = run_layouts(tmp_path, world, CASES[world], MOE)
    assert set(results) == set(CASES[world])
    assert reference["loss"][0] - reference["loss"][-1] > 1e-3  # the steps move the weights
    # every token of the global batch routed twice, in layer 0, summed over the ranks
    assert [sum(load) for load in reference["expert_load"]] == [8 * 32 * 2] * STEPS
    for name, got in results.items():
        assert got["val_loss"] is not None, name
        assert_trains_like(got, reference, LR, name)
        assert got["expert_load"][0] == reference["expert_load"][0], name  # same weights, same routing
    # Experts written by their own ranks (DCP, sharded over the expert axis) load on one process.
    expected = load_model(reference["dir"]).state_dict()
    for name in {next(iter(CASES[world])), "expert=2 x tensor=2" if world == 4 else "tensor=2"}:
        got = load_model(tmp_path / "results.json.runs" / name).state_dict()
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-4, msg=f"{name}: {key}")
