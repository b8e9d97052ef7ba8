"""ember: PyTorch-native LLM training, from a laptop CPU to thousands of accelerators."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["load_model", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import ember` (and `ember --help`) does not pay for importing torch.
    if name == "load_model":
        from ember.model_io.load import load_model

        return load_model
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
