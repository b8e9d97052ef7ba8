"""Every model family trains on the XLA path (device=xla, 8 virtual jax CPU devices): two steps each at a tiny size,
all in one process so jax starts once; and what the path refuses is refused before any file is written."""

from pathlib import Path

import pytest
import torch

from ember.errors import ConfigError
from ember.models import MODELS
from ember.train import run as run_lib
from tests.helpers import run_ember
from tests.xla.conftest import run_xla_script

# Each family at a tiny size (2 layers, width 64) with its own pieces switched on where the debug flavor has them
# off or too large for a 16-token sequence: windows and chunks shorter than it, experts few and narrow.
TINY = ["data.dataset=synthetic", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.vocab_size=256",
        "seq_len=16", "global_batch_size=8", "micro_batch_size=1", "max_steps=2", "logging_steps=1",
        "eval_batches=1", "metrics.console=false"]
OWN = {
    "mixtral": ["model.n_experts=4", "model.top_k=2", "model.n_kv_heads=2"],
    "glam": ["model.n_experts=4"],
    "mistral": ["model.sliding_window=8", "model.n_kv_heads=2"],
    "phi3": ["model.sliding_window=8", "model.n_kv_heads=2"],
    "llama4": ["model.n_experts=4", "model.moe_hidden_dim=32", "model.attention_chunk=8", "model.n_kv_heads=2"],
    "gemma3": ["model.sliding_window=8", "model.n_kv_heads=2"],
    "gemma2": ["model.sliding_window=8", "model.n_kv_heads=2"],
    "qwen3": ["model.sliding_window=8", "model.max_window_layers=1", "model.n_kv_heads=2"],
    "qwen3_moe": ["model.n_experts=4", "model.top_k=2", "model.moe_hidden_dim=32", "model.n_kv_heads=2"],
    # MLA has no K/V heads to set; V3's score biases held still, as the XLA path requires
    "deepseek_v3": ["model.n_kv_heads=null", "model.n_experts=8", "model.top_k=2", "model.moe_hidden_dim=32",
                    "model.bias_update_rate=0"],
    "deepseek_v2": ["model.n_kv_heads=null", "model.n_experts=8", "model.top_k=2", "model.moe_hidden_dim=32"],
}
REFUSED: dict[str, str] = {}  # every family trains on this path; a family added later lands here or in OWN


def family_overrides(family: str) -> list[str]:
    flavor = "debug" if "debug" in MODELS[family].flavors else next(iter(MODELS[family].flavors))
    return [f"model.family={family}", f"model.flavor={flavor}", *TINY, *OWN.get(family, [])]


TRAIN_ALL = """
import json, sys
from ember.train import run as run_lib
from ember.train.trainer import Trainer
out, cases = sys.argv[1], json.loads(sys.argv[2])
results = {}
for family, overrides in cases.items():
    cfg = run_lib.load_config("debug", [*overrides, "device=xla", f"output_dir={out}/{family}"])
    summary = Trainer(cfg).train()
    results[family] = [summary["first_loss"], summary["final_loss"], summary["steps"]]
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_family_trains_two_steps_on_eight_devices(tmp_path: Path):
    import json

    cases = {family: family_overrides(family) for family in MODELS if family not in REFUSED}
    results = run_xla_script(TRAIN_ALL, str(tmp_path), json.dumps(cases))
    assert sorted(results) == sorted(cases)
    for family, (first, final, steps) in results.items():
        assert steps == 2 and first == first and final == final, (family, first, final)  # finite, both steps ran


def test_every_buffer_init_rope_leaves_is_zero_after_init(monkeypatch):
    """The XLA path's compiled step holds the model's buffers as constants; a buffer the traced (meta) model does not
    fill with init_rope gets zeros there (ember/xla/layout.py _initial_buffer), so the torch init must give zeros."""
    for family, spec in MODELS.items():
        cfg = run_lib.load_config("debug", family_overrides(family))
        args = run_lib.model_choice(cfg).args
        with torch.device("meta"):
            traced = spec.model_cls(args)
        traced.init_rope(torch.device("cpu"))
        model = spec.model_cls(args)
        model.init_weights()
        for name, buffer in traced.named_buffers():
            if buffer.is_meta:
                assert torch.count_nonzero(model.get_buffer(name)) == 0, (family, name)


def test_compile_true_is_refused_before_any_file_is_written(tmp_path: Path):
    message = ("compile=true is not supported with device=xla; "
               "use compile=false (the whole step is compiled by XLA already)")
    with pytest.raises(ConfigError, match=r"^compile=true is not supported with device=xla"):
        run_lib.load_config("debug", ["device=xla", "compile=true", "micro_batch_size=1"], world_size=8)
    proc = run_ember("train", "debug", "device=xla", "compile=true", f"output_dir={tmp_path / 'run'}", expect=2)
    assert proc.stderr == f"error: {message}\n" and not (tmp_path / "run").exists()
    proc = run_ember("launch", "xpk", "--cluster", "c", "--tpu-type", "v6e-8", "--docker-image", "gcr.io/p/e:1",
                     "debug", "compile=true", "--print", expect=2)
    assert proc.stderr.strip().splitlines()[-1] == f"error: {message.replace('device=xla', 'device=tpu')}"


@pytest.mark.parametrize("overrides, differ", [
    (["model.family=llama4", "model.n_layers=4"],
     "chunked-attention layers (64-token chunks) and full-attention layers; RoPE and NoPE layers; "
     "dense and MoE layers"),
    (["model.family=qwen3", "model.sliding_window=8", "model.max_window_layers=2"],
     "full-attention layers and sliding-window layers (8-token window)"),
    (["model.family=gemma3"], "full-attention layers and sliding-window layers (64-token window); local layers with "
                              "their own RoPE base"),
])
def test_a_scan_refusal_names_what_differs_in_the_model(overrides, differ):
    from ember.xla import checks

    cfg = run_lib.load_config("debug", overrides)
    cfg.model.scan_layers = True
    with pytest.raises(ConfigError) as info:
        checks.check_scan(cfg, run_lib.model_choice(cfg).args)
    assert str(info.value) == (f"model.scan_layers=true needs every block alike, and this {cfg.model.family} model's "
                               f"blocks differ ({differ}); drop model.scan_layers")
