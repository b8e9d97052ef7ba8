"""Pre-tokenized shards (`ember data prepare`) and weighted mixtures."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_testing import SMALL_VOCAB, DataCfg

from ember.config import MixtureSource
from ember.data import prepare as prepare_lib
from ember.data.loader import MixtureSamples, PackedSamples, build_loader
from ember.data.prepare import MANIFEST, load_prepared, prepare
from ember.data.tokenizer import Tokenizer, build_tokenizer
from tests.helpers import run_ember


def _docs(path: Path, n: int, word: str) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} {i} " * (1 + i % 7)}) + "\n" for i in range(n)))
    return path


def test_prepare_writes_tokens_and_manifest_equal_to_on_the_fly(tmp_path: Path, small_tokenizer: Tokenizer):
    src = _docs(tmp_path / "docs.jsonl", 300, "word")
    out = tmp_path / "prepared"
    cfg = DataCfg(dataset=str(src))
    manifest = prepare(cfg, small_tokenizer, out)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert manifest["tokenizer"]["identity"] == small_tokenizer.identity
    for split in ("train", "val"):
        info = manifest["splits"][split]
        on_the_fly = prepare_lib.token_stream(cfg, small_tokenizer, split).tokens
        prepared = load_prepared(out, split, small_tokenizer)
        assert isinstance(prepared.tokens, np.memmap)
        assert np.array_equal(np.asarray(prepared.tokens), on_the_fly)  # the same stream, no tokenizer needed
        assert info["num_tokens"] == len(on_the_fly) and info["dtype"] == "uint16"
        assert info["num_documents"] == prepared.num_documents
    assert manifest["splits"]["train"]["num_documents"] + manifest["splits"]["val"]["num_documents"] == 300
    # Training reads it through data.dataset=DIR like any source.
    loader = build_loader(DataCfg(dataset=str(out), num_workers=0), small_tokenizer, seq_len=8, micro_batch_size=2)
    assert next(loader)[0].shape == (2, 8)


def test_prepared_data_is_refused_with_another_tokenizer_or_when_truncated(tmp_path: Path, small_tokenizer: Tokenizer,
                                                                          small_corpus: Path):
    out = tmp_path / "prepared"
    prepare(DataCfg(dataset=str(_docs(tmp_path / "d.jsonl", 50, "w"))), small_tokenizer, out)
    other = build_tokenizer(DataCfg(), 384)
    with pytest.raises(ValueError, match=r"was tokenized with .* but this run uses .*; set data.tokenizer to the same"):
        load_prepared(out, "train", other)
    data = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"train\.bin' holds \d+ bytes but the manifest says \d+ uint16 tokens"):
        load_prepared(out, "train", small_tokenizer)
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json' is not a readable manifest"):
        load_prepared(out, "train", small_tokenizer)


@pytest.mark.slow
def test_cli_prepare_end_to_end(tmp_path: Path):
    src = _docs(tmp_path / "docs.jsonl", 200, "token")
    tok_dir = tmp_path / "tok"
    run_ember("data", "tokenizer", "train", str(src), str(tok_dir), "--vocab-size", "300", timeout=300, expect=0)
    proc = run_ember("data", "prepare", str(src), str(tmp_path / "out"), "--tokenizer", str(tok_dir / "tokenizer.json"),
                     timeout=300, expect=0)
    assert "train: " in proc.stdout and f"data.dataset={tmp_path / 'out'}" in proc.stdout
    assert (tmp_path / "out" / MANIFEST).is_file()
    proc = run_ember("data", "prepare", str(tmp_path / "missing.jsonl"), str(tmp_path / "out2"), timeout=300, expect=2)
    assert proc.stderr == f"error: SOURCE path '{tmp_path / 'missing.jsonl'}' does not exist; check the path\n"
    assert not (tmp_path / "out2").exists()


def _packed(n: int, value: int) -> PackedSamples:
    rows = np.full((n, 5), value, dtype=np.uint16)
    rows[:, 0] = np.arange(n)  # row id, to follow each source's order
    return PackedSamples(rows)


def test_mixture_weights_hold_in_expectation_and_sources_wrap():
    mix = MixtureSamples([_packed(10, 1), _packed(1000, 2), _packed(1000, 3)], [0.4, 0.5, 0.1], ["a", "b", "c"], seed=3)
    batch, mask = mix.get(np.arange(20000))
    assert mask is None
    shares = [(batch[:, 1] == v).float().mean().item() for v in (1, 2, 3)]
    # 20,000 draws: the standard error of a share is <= 0.0035, so 0.015 is over 4 of them.
    assert shares == pytest.approx([0.4, 0.5, 0.1], abs=0.015)
    assert mix.source_counts(20000) == {"a": int((batch[:, 1] == 1).sum()), "b": int((batch[:, 1] == 2).sum()),
                                         "c": int((batch[:, 1] == 3).sum())}
    # Source "a" has 10 rows and supplied ~8,000 samples: it wrapped into new epochs, each a full
    # permutation of its rows (every row once per epoch), and the others went on undisturbed.
    a_rows = batch[batch[:, 1] == 1][:, 0]
    for epoch in range(5):
        assert sorted(a_rows[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    assert not torch.equal(a_rows[:10], a_rows[10:20])  # reshuffled per epoch
    # A function of the global index alone: any slice equals the same rows read in one go.
    assert torch.equal(mix.get(np.arange(12345, 12400))[0], batch[12345:12400])
    fresh = MixtureSamples([_packed(10, 1), _packed(1000, 2), _packed(1000, 3)], [0.4, 0.5, 0.1], ["a", "b", "c"],
                           seed=3)
    assert torch.equal(fresh.get(np.arange(19990, 20000))[0], batch[19990:20000])


def test_mixture_from_config_and_its_errors(tmp_path: Path, small_tokenizer: Tokenizer):
    a, b = _docs(tmp_path / "a.jsonl", 200, "alpha"), _docs(tmp_path / "b.jsonl", 200, "beta")
    cfg = DataCfg(mixture=[MixtureSource(str(a), 3.0), MixtureSource(str(b), 1.0)], num_workers=0)
    loader = build_loader(cfg, small_tokenizer, seq_len=8, micro_batch_size=4)
    for _ in range(50):
        next(loader)
    counts = loader.mixture_counts()
    assert set(counts) == {str(a), str(b)} and sum(counts.values()) == 200
    assert 0.6 < counts[str(a)] / 200 < 0.9  # weight 3:1
    assert "mixture of" in loader.describe()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("two words")
    cfg = DataCfg(mixture=[MixtureSource(str(a), 1.0), MixtureSource(str(tiny), 1.0)], num_workers=0)
    with pytest.raises(ValueError,
                       match=r"data\.mixture\[1\] '.*tiny\.txt' \(train split\) has \d+ tokens, not one sample"):
        build_loader(cfg, small_tokenizer, seq_len=64, micro_batch_size=4, vocab_size=SMALL_VOCAB)


def test_a_mixture_source_missing_its_text_column_names_its_own_key(tmp_path: Path, small_tokenizer: Tokenizer):
    good, odd = tmp_path / "good.jsonl", tmp_path / "odd.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    odd.write_text("".join(json.dumps({"body": f"other {i} " * 20}) + "\n" for i in range(40)))
    cfg = DataCfg(mixture=[MixtureSource(str(good), 1.0), MixtureSource(str(odd), 1.0)], num_workers=0)
    with pytest.raises(ValueError, match=r"odd\.jsonl line 1 has no 'text' field \(it has: body\); "
                                         r"set data\.mixture\[1\]\.text_field"):
        build_loader(cfg, small_tokenizer, seq_len=8, micro_batch_size=2)
    cfg = DataCfg(mixture=[MixtureSource(str(good), 1.0), MixtureSource(str(odd), 1.0, text_field="body")],
                  num_workers=0)
    assert build_loader(cfg, small_tokenizer, seq_len=8, micro_batch_size=2).mixture_counts() is not None
