"""The families on the shared decoder with pieces of their own (Qwen2's q/k/v biases, Qwen3's per-head q/k
norms and wide heads, sliding windows, Qwen3-MoE's experts, Llama 4's chunks, NoPE temperature and shared expert,
DeepSeek's MLA with its shared rope key and grouped routing) train exactly like one process on the meshes that
split those pieces: tensor (+ sequence) parallel splits the biases and the heads the norms run over, context
parallelism cuts the sequence a window slides along, a pipeline stage holds some of the blocks, expert
parallelism the experts. Tolerances: tests.helpers.assert_trains_like (step 1 and every loss to fp32 summation
order; later gradient norms to what Adam's first updates amplify), checked under two CPUs' kernels."""

import pytest

from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import assert_trains_like, read_records, run_layouts, tiny_model

pytestmark = pytest.mark.slow  # torchrun jobs

STEPS = 3
LR = 1e-2
COMMON = ["data.dataset=synthetic", *tiny_model(4), "model.vocab_size=512", "model.ffn_hidden_dim=96", "seq_len=32",
          "global_batch_size=8", f"max_steps={STEPS}", "logging_steps=1", "eval_batches=1",
          "schedule.warmup_steps=0", f"optim.lr={LR}", "model.flavor=debug"]
FAMILIES = {
    "qwen2": ["model.family=qwen2"],
    # the debug flavor's heads of 64 from a width of 64 (wider than dim / n_heads); a window on layers 2-3
    "qwen3": ["model.family=qwen3", "model.sliding_window=8", "model.max_window_layers=2"],
    "qwen3_moe": ["model.family=qwen3_moe", "model.n_experts=4", "model.top_k=2", "model.moe_hidden_dim=32",
                  "model.aux_loss_coef=0"],
    # MLA (no K/V heads to set: n_kv_heads unset), a dense first layer, then 8 experts in the debug flavor's 4 groups
    # with V3's score bias (moved by the summed load each step) and a shared expert
    "deepseek_v3": ["model.family=deepseek_v3", "model.n_kv_heads=null", "model.n_experts=8", "model.top_k=2",
                    "model.moe_hidden_dim=32", "model.aux_loss_coef=0"],
    # V2-Lite's form: q straight from x (column-wise wq, no q latent), softmax routing without groups
    "deepseek_v2": ["model.family=deepseek_v2", "model.n_kv_heads=null", "model.n_experts=8", "model.top_k=2",
                    "model.moe_hidden_dim=32", "model.aux_loss_coef=0"],
    "mistral": ["model.family=mistral", "model.sliding_window=8"],
    "phi3": ["model.family=phi3", "model.sliding_window=8"],
    # 6 layers: 5 local (window 8, their own RoPE base) and 1 global; four (1 + w) norms per block, q/k norms
    "gemma3": ["model.family=gemma3", "model.n_layers=6", "model.sliding_window=8"],
    "gemma2": ["model.family=gemma2", "model.sliding_window=8"],  # soft-capped scores and logits
    # layers 1 and 3 with experts (a shared one, input-scaled sigmoid top-1), 0-2 chunked RoPE with weightless q/k
    # norms, 3 NoPE with a temperature that changes inside the sequence
    "llama4": ["model.family=llama4", "model.n_experts=4", "model.moe_hidden_dim=32", "model.attention_chunk=8",
               "model.floor_scale=4", "model.attn_scale=0.5", "model.aux_loss_coef=0"],
}
SPLIT = ["micro_batch_size=4", "ici_mesh.fsdp=1"]
LAYOUTS = {
    "qwen2": {"fsdp=2": ["micro_batch_size=4"], "tensor=2": SPLIT + ["ici_mesh.tensor=2"]},
    "qwen3": {"tensor=2": SPLIT + ["ici_mesh.tensor=2"], "context=2": SPLIT + ["ici_mesh.context=2"]},
    # untied (a tied model cannot be cut into pipeline stages), with Qwen3's q/k norms
    "qwen3_moe": {"expert=2": SPLIT + ["ici_mesh.expert=2"], "tensor=2": SPLIT + ["ici_mesh.tensor=2"],
                  "fsdp=2": ["micro_batch_size=4"],
                  "pipeline=2": SPLIT + ["ici_mesh.pipeline=2", "parallel.pp_schedule=1f1b"]},
    "deepseek_v3": {"tensor=2": SPLIT + ["ici_mesh.tensor=2"], "expert=2": SPLIT + ["ici_mesh.expert=2"],
                    "context=2": SPLIT + ["ici_mesh.context=2"], "fsdp=2": ["micro_batch_size=4"],
                    "pipeline=2": SPLIT + ["ici_mesh.pipeline=2", "parallel.pp_schedule=1f1b"]},
    "deepseek_v2": {"tensor=2": SPLIT + ["ici_mesh.tensor=2"]},
    "mistral": {"context=2": SPLIT + ["ici_mesh.context=2"],
                "tensor=2 x fsdp": ["micro_batch_size=4", "ici_mesh.tensor=2"]},
    "phi3": {"tensor=2": SPLIT + ["ici_mesh.tensor=2"]},
    "gemma3": {"tensor=2": SPLIT + ["ici_mesh.tensor=2"], "context=2": SPLIT + ["ici_mesh.context=2"]},
    "gemma2": {"tensor=2 x fsdp": ["micro_batch_size=4", "ici_mesh.tensor=2"]},
    "llama4": {"expert=2": SPLIT + ["ici_mesh.expert=2"], "tensor=2": SPLIT + ["ici_mesh.tensor=2"],
               "context=2": SPLIT + ["ici_mesh.context=2"],
               "pipeline=2": SPLIT + ["ici_mesh.pipeline=2", "parallel.pp_schedule=1f1b"]},
}


def _single_process(out, overrides: list[str]) -> dict:
    cfg = run_lib.load_config("debug", [*COMMON, *overrides, "micro_batch_size=8", f"output_dir={out}",
                                        "metrics.console=false"])
    summary = Trainer(cfg).train()
    steps = [r for r in read_records(out) if "loss" in r]
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "val_loss": summary["val_loss"]}


def test_family_layouts_match_single_process(tmp_path):
    cases = {f"{family} {name}": FAMILIES[family] + overrides
             for family, layouts in LAYOUTS.items() for name, overrides in layouts.items()}
    results = run_layouts(tmp_path, 2, cases, COMMON)
    assert set(results) == set(cases)
    for family in LAYOUTS:
        expected = _single_process(tmp_path / f"reference-{family}", FAMILIES[family])
        assert abs(expected["loss"][0] - expected["loss"][-1]) > 1e-3, family  # the steps move the weights
        for name in LAYOUTS[family]:
            assert_trains_like(results[f"{family} {name}"], expected, LR, f"{family} {name}")
