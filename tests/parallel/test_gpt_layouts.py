"""GPT under parallel layouts: the losses and gradient norms of the first steps equal the single-process
run's, as tests/parallel/test_layouts.py shows for Llama (with the same torchrun worker, layouts_worker.py).
What GPT adds to Llama's plan is checked here: the learned position table (row-sharded under tensor
parallelism, indexed by each context rank's true positions), biases in column- and row-wise projections,
and sequence-parallel LayerNorms with a bias.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember import config as config_lib
from ember.train import Trainer

HERE = Path(__file__).parent
STEPS = 3
REL = 1e-5  # fp32; only the order of floating-point sums differs between layouts
# A small GPT: 2 layers, 4 heads (tensor=2), seq 32 (context=2 makes 4 chunks), tied embeddings.
BASE = [
    "data.dataset=synthetic", "model.family=gpt", "model.n_layers=2", "model.dim=64", "model.n_heads=4",
    "model.ffn_hidden_dim=256", "model.vocab_size=512", "seq_len=32", "global_batch_size=8", f"max_steps={STEPS}",
    "logging_steps=1", "eval_batches=1", "schedule.warmup_steps=0", "optim.lr=1e-2",
]
WORLD2 = {
    "gpt fsdp=2": ["micro_batch_size=4"],
    "gpt tensor=2 + loss parallel": ["micro_batch_size=4", "ici_mesh.tensor=2"],
    "gpt context=2 (all-gather K/V)": ["micro_batch_size=4", "ici_mesh.context=2"],
}


def test_gpt_world_size_2_layouts_match_single_process(tmp_path):
    cfg = config_lib.load("debug", BASE + ["micro_batch_size=8", f"output_dir={tmp_path / 'reference'}",
                                           "metrics.console=false"])
    summary = Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    reference = [r for r in records if "loss" in r]
    # Uniform random tokens start at the loss floor (ln 512); the weights still move, so the steps' losses
    # differ and agreement is not that of an untouched model.
    assert len(reference) == STEPS and abs(reference[0]["loss"] - reference[-1]["loss"]) > 1e-3
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "layouts_worker.py"), str(out), json.dumps(WORLD2), *BASE]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == set(WORLD2)
    for name, got in results.items():
        assert got["loss"] == pytest.approx([r["loss"] for r in reference], rel=REL), name
        assert got["grad_norm"] == pytest.approx([r["grad_norm"] for r in reference], rel=REL), name
        assert got["val_loss"] == pytest.approx(summary["val_loss"], rel=REL), name
