"""GPT under parallel layouts: the losses and gradient norms of the first steps equal the single-process
run's, as tests/parallel/test_layouts.py shows for Llama (with the same torchrun worker, layouts_worker.py).
What GPT adds to Llama's plan is checked here: the learned position table (row-sharded under tensor
parallelism, indexed by each context rank's true positions), biases in column- and row-wise projections,
and sequence-parallel LayerNorms with a bias.
"""

import pytest

from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import assert_trains_like, read_records, run_layouts

# A torchrun job.
pytestmark = pytest.mark.slow

STEPS = 3
LR = 1e-2  # tolerances: tests.helpers.assert_trains_like
# A small GPT: 2 layers, 4 heads (tensor=2), seq 32 (context=2 makes 4 chunks), tied embeddings.
BASE = [
    "data.dataset=synthetic", "model.family=gpt", "model.n_layers=2", "model.dim=64", "model.n_heads=4",
    "model.ffn_hidden_dim=256", "model.vocab_size=512", "seq_len=32", "global_batch_size=8", f"max_steps={STEPS}",
    "logging_steps=1", "eval_batches=1", "schedule.warmup_steps=0", f"optim.lr={LR}",
]
WORLD2 = {
    "gpt fsdp=2": ["micro_batch_size=4"],
    "gpt tensor=2 + loss parallel": ["micro_batch_size=4", "ici_mesh.tensor=2"],
    "gpt context=2 (all-gather K/V)": ["micro_batch_size=4", "ici_mesh.context=2"],
}


def test_gpt_world_size_2_layouts_match_single_process(tmp_path):
    cfg = run_lib.load_config("debug", BASE + ["micro_batch_size=8", f"output_dir={tmp_path / 'reference'}",
                                           "metrics.console=false"])
    summary = Trainer(cfg).train()
    reference = [r for r in read_records(tmp_path / "reference") if "loss" in r]
    # Uniform random tokens start at the loss floor (ln 512); the weights still move, so the steps' losses
    # differ and agreement is not that of an untouched model.
    assert len(reference) == STEPS and abs(reference[0]["loss"] - reference[-1]["loss"]) > 1e-3
    results = run_layouts(tmp_path, 2, WORLD2, BASE)
    assert set(results) == set(WORLD2)
    expected = {"loss": [r["loss"] for r in reference], "grad_norm": [r["grad_norm"] for r in reference],
                "val_loss": summary["val_loss"]}
    for name, got in results.items():
        assert got["val_loss"] is not None, name
        assert_trains_like(got, expected, LR, name)
