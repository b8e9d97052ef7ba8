"""The Hugging Face `datasets` library, imported only where a source needs it (an optional dependency, and
slow to import): hub datasets for training data, DPO pairs and eval tasks, tables and streams of local files.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Iterator, Optional

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
    one-line error, followed by `fix`. A hub that cannot be reached is found in seconds and the table read from
    the local cache, so no network means one line at once, not a minute of retries."""
    datasets = import_datasets(f"{what} '{name}' is not a local file, folder or glob; loading it from the Hugging "
                               "Face hub")
    from huggingface_hub import constants

    offline = any(getattr(module, switch) for module, switch in _offline_switches(datasets))  # set by the user
    unreachable = None if offline else _unreachable(constants.ENDPOINT)
    try:
        with _hub_call(datasets, offline=unreachable is not None):
            return datasets.load_dataset(name, config, split=hf_split)
    except Exception as err:  # network, auth, unknown name or config: all user-fixable, all one line
        cache_miss = unreachable and isinstance(err, ConnectionError)  # offline: what the cache lacks
        reason = (f"{constants.ENDPOINT} cannot be reached ({unreachable}) and it is not in the local cache"
                  if cache_miss else first_error_line(err))
        raise DataError(f"cannot load {what} '{name}' from the Hugging Face hub: {reason}{fix}") from None


def _unreachable(endpoint: str) -> Optional[str]:
    """Why the hub at `endpoint` cannot be reached (a name that does not resolve, a refused or timed-out
    connection), or None. Behind a proxy (HTTPS_PROXY etc.) the hub is reached through it: not probed."""
    import os
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                           "all_proxy")):
        return None
    url = urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=3):
            return None
    except OSError as err:
        return err.strerror or first_error_line(err)  # strerror: without the errno


def _offline_switches(datasets: ModuleType) -> list[tuple[ModuleType, str]]:
    """Where huggingface_hub and datasets keep HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (read from the environment
    when they are imported; the names vary with the datasets version)."""
    from huggingface_hub import constants

    candidates = ((constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                  (datasets.config, "HF_DATASETS_OFFLINE"))
    return [(module, name) for module, name in candidates if hasattr(module, name)]


@contextmanager
def _hub_call(datasets: ModuleType, offline: bool) -> Iterator[None]:
    """The hub clients quiet for one call (their retries log a line each), and offline when `offline`: from the
    local cache only, as HF_HUB_OFFLINE=1 would read it."""
    import logging

    switches = _offline_switches(datasets)
    saved = [getattr(module, name) for module, name in switches]
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    for module, name in switches if offline else ():
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(switches, saved):
            setattr(module, name, value)
        hub_log.setLevel(level)
