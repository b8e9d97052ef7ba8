"""model.scan_layers refuses a model whose blocks differ: one scanned block stands for all of them."""

import pytest

from ember import run as run_lib
from ember.errors import ConfigError
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
