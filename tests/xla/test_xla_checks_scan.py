"""What the XLA path refuses of a model: model.scan_layers where blocks differ (one scanned block stands for all of
them), and score-bias updates its compiled step cannot make."""

import pytest

from ember.errors import ConfigError
from ember.train import run as run_lib
from ember.xla import checks


@pytest.mark.parametrize("overrides, alike", [
    (["model.family=mistral"], True),  # the same window on every layer
    (["model.family=qwen3", "model.sliding_window=8", "model.max_window_layers=2"], False),
    (["model.family=qwen3_moe", "model.sparse_step=2"], False),
    (["model.family=gemma3"], False),  # local and global layers, two RoPE tables
    ([], True),
])
def test_scan_needs_blocks_alike(overrides, alike):
    cfg = run_lib.load_config("debug", overrides)
    cfg.model.scan_layers = True
    args = run_lib.model_choice(cfg).args
    if alike:
        checks.check_scan(cfg, args)
    else:
        with pytest.raises(ConfigError, match=r"^model.scan_layers=true needs every block alike, and this .* differ"):
            checks.check_scan(cfg, args)


@pytest.mark.parametrize("family, rate, refused", [("deepseek_v3", 0.001, True), ("deepseek_v3", 0.0, False),
                                                   ("deepseek_v2", 0.001, False), ("llama4", 0.001, False)])
def test_score_bias_updates_are_refused_where_the_step_holds_buffers_as_constants(family, rate, refused):
    overrides = [f"model.family={family}", f"model.bias_update_rate={rate}", "device=xla"]
    if not refused:
        cfg = run_lib.load_config("debug", overrides)
        checks.check_score_bias(cfg, run_lib.model_choice(cfg).args)
        return
    with pytest.raises(ConfigError, match=r"^device=xla does not update the routers' score biases .* "
                                          r"set model.bias_update_rate=0"):
        run_lib.load_config("debug", overrides)  # refused with the config, before any work
