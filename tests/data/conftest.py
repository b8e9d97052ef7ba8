"""Fixtures for the data tests: a small copy of the embedded corpus and a private cache directory.

Training the real tokenizer on the whole 30 MB standard library takes seconds per test; a dozen
stdlib files (~120 KB) exercise the same code in a fraction of a second.
"""

import shutil
import sysconfig
from pathlib import Path

import pytest
from data_testing import CORPUS_FILES, LATIN1_FILE, SMALL_VOCAB, DataCfg

from ember.data import sources
from ember.data.tokenizer import Tokenizer, build_tokenizer


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("EMBER_CACHE", str(path))
    return path


@pytest.fixture
def small_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> Path:
    """A stand-in stdlib: a few real modules, a site-packages to ignore, one latin-1 file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path / "stdlib"
    for name in CORPUS_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib / name, root / name)
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "site-packages" / "pkg" / "installed.py").write_text("x = 1\n")
    (root / LATIN1_FILE).write_bytes("# caf\xe9 en latin-1\nname = 'Andr\xe9'\n".encode("latin-1"))
    monkeypatch.setattr(sources, "embedded_root", lambda: root)
    return root


@pytest.fixture
def small_tokenizer(small_corpus: Path) -> Tokenizer:
    return build_tokenizer(DataCfg(), SMALL_VOCAB)
