"""Packing: EOS between documents, the token dtype, windows of seq_len+1, and the token cache."""

from pathlib import Path

import numpy as np
import pytest
from data_testing import LATIN1_FILE, DataCfg

from ember.data import packing, prepare, sources
from ember.data.tokenizer import Tokenizer


def test_documents_are_joined_with_eos(small_tokenizer: Tokenizer):
    docs = ["first document\n", "second", "x = [1, 2, 3]\n"]
    tokens = packing.tokenize_documents(docs, small_tokenizer)
    expected = [t for d in docs for t in small_tokenizer.encode(d) + [small_tokenizer.eos_id]]
    assert tokens.tolist() == expected
    assert tokens.dtype == np.uint16
    # Split at EOS, each piece decodes back to its document.
    pieces = np.split(tokens, np.flatnonzero(tokens == small_tokenizer.eos_id) + 1)[:-1]
    assert [small_tokenizer.decode(p[:-1].tolist()) for p in pieces] == docs


def test_token_dtype():
    assert packing.token_dtype(8192) == np.uint16 and packing.token_dtype(65536) == np.uint16
    assert packing.token_dtype(65537) == np.uint32 and packing.token_dtype(128256) == np.uint32


def test_pack_windows_and_shift():
    tokens = np.arange(23, dtype=np.uint16)
    rows = packing.pack(tokens, seq_len=4)  # windows of 5, the last 3 tokens dropped
    assert rows.shape == (4, 5) and np.shares_memory(rows, tokens)  # a view: memory maps stay on disk
    assert rows[:, 0].tolist() == [0, 5, 10, 15]
    inputs, labels = rows[:, :-1], rows[:, 1:]
    assert (labels[:, :-1] == inputs[:, 1:]).all() and (labels == inputs + 1).all()
    assert packing.pack(tokens[:4], seq_len=4).shape == (0, 5)


def test_token_stream_is_cached(small_tokenizer: Tokenizer, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    first = prepare.token_stream(DataCfg(), small_tokenizer, "train")
    assert first.skipped == [LATIN1_FILE] and first.num_documents > 5
    (npy,) = (cache_dir / "tokens").glob("*-train.npy")
    assert small_tokenizer.identity in npy.name

    def no_reading(*args, **kwargs):
        raise AssertionError("read and tokenized the corpus although its tokens are cached")

    monkeypatch.setattr(sources, "load_documents", no_reading)
    second = prepare.token_stream(DataCfg(), small_tokenizer, "train")
    assert isinstance(second.tokens, np.memmap) and not second.tokens.flags.writeable
    assert np.array_equal(second.tokens, first.tokens)
    assert (second.name, second.num_documents, second.skipped) == (first.name, first.num_documents, first.skipped)
    assert not [p for p in (cache_dir / "tokens").iterdir() if p.name.startswith(".")]  # no temporary files left


def test_token_cache_key_follows_the_source(small_tokenizer: Tokenizer, small_corpus: Path, cache_dir: Path):
    prepare.token_stream(DataCfg(), small_tokenizer, "train")
    (small_corpus / "added.py").write_text("added = True\n" * 50)
    prepare.token_stream(DataCfg(), small_tokenizer, "train")
    prepare.token_stream(DataCfg(val_fraction=0.3), small_tokenizer, "train")
    assert len(list((cache_dir / "tokens").glob("*-train.npy"))) == 3


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path):
    def fail(f):
        f.write(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        sources.atomic_write(tmp_path / "out.npy", fail)
    assert list(tmp_path.iterdir()) == []
