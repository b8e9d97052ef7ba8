"""Constants and locations shared across the package (data, nn, hardware), with no dependencies of their own."""

from __future__ import annotations

import os
from pathlib import Path

# Labels equal to this add nothing to the loss (SFT prompts, padding): PyTorch's cross_entropy default.
IGNORE_INDEX = -100


def default_cache_dir() -> Path:
    """Where ember keeps what it derives once per machine (tokenizers, token caches, the CPU peak):
    $EMBER_CACHE, else $XDG_CACHE_HOME/ember, else ~/.cache/ember."""
    if os.environ.get("EMBER_CACHE"):
        return Path(os.environ["EMBER_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ember"
