"""The Hugging Face `datasets` library, imported only where a source needs it (an optional dependency, and
slow to import): hub datasets for training data, DPO pairs and eval tasks, tables and streams of local files.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Optional

from ember.errors import DataError, first_error_line

if TYPE_CHECKING:
    import datasets


def import_datasets(purpose: str) -> ModuleType:
    """The `datasets` module, quiet; `purpose` names what needs it in the one-line error when it is missing."""
    try:
        import datasets  # lazy: an optional dependency, and slow to import
    except ImportError:
        raise DataError(f"{purpose} needs the `datasets` library; run `pip install datasets`") from None
    # Its progress bars and info logs would break into ember's console (progress bar, metrics lines).
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_hub_table(name: str, config: Optional[str], hf_split: str, what: str = "data.dataset",
                   fix: str = "") -> datasets.Dataset:
    """A hub dataset's `hf_split` as a `datasets` table; `what` names who asked (a key, an eval task) in the
    one-line error, followed by `fix`."""
    datasets = import_datasets(f"{what} '{name}' is not a local file, folder or glob; loading it from the Hugging "
                               "Face hub")
    try:
        return datasets.load_dataset(name, config, split=hf_split)
    except Exception as err:  # network, auth, unknown name or config: all user-fixable, all one line
        raise DataError(f"cannot load {what} '{name}' from the Hugging Face hub: {first_error_line(err)}{fix}") from None
