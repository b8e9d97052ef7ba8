"""The tokenizer: round trip, special ids, the trained-once cache, loading a tokenizer.json, the vocab check."""

import json
from pathlib import Path

import pytest
from data_testing import SMALL_VOCAB, DataCfg

from ember.data import tokenizer as tokenizer_lib
from ember.data.tokenizer import BOS, EOS, PAD, Tokenizer, build_tokenizer

TEXT = 'def f(x):\n    return {"café": x ** 2}  # ünïcode, tabs\t and   spaces\n\n€ 日本語 🙂\n'


def test_round_trip_and_batch_encode(small_tokenizer: Tokenizer):
    ids = small_tokenizer.encode(TEXT)
    assert small_tokenizer.decode(ids) == TEXT  # byte-level: any text survives, nothing is unknown
    assert all(0 <= i < small_tokenizer.vocab_size for i in ids)
    texts = [TEXT, "import os\n", "", "x" * 1000]
    assert small_tokenizer.encode_batch(texts) == [small_tokenizer.encode(t) for t in texts]


def test_special_ids_and_identity(small_tokenizer: Tokenizer):
    tok = small_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert [tok.tok.id_to_token(i) for i in (0, 1, 2)] == [BOS, EOS, PAD]
    assert tok.vocab_size == SMALL_VOCAB
    assert tok.eos_id not in tok.encode(f"a document quoting {EOS} literally")  # text never makes a special id
    assert tok.decode([tok.eos_id]) == EOS
    assert len(tok.identity) == 16
    assert build_tokenizer(DataCfg(), SMALL_VOCAB).identity == tok.identity  # stable across loads


def test_second_build_reads_the_cache(small_corpus: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    first = build_tokenizer(DataCfg(), SMALL_VOCAB)
    (cached,) = (cache_dir / "tokenizers").glob("*.json")
    mtime = cached.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the cache holds this tokenizer")

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_lib, "train_bpe", no_training)
        second = build_tokenizer(DataCfg(), SMALL_VOCAB)
    assert second.identity == first.identity and cached.stat().st_mtime_ns == mtime
    assert not list((cache_dir / "tokenizers").glob(".*"))  # written atomically: no temporary file left over
    # Another vocab size is another tokenizer.
    assert build_tokenizer(DataCfg(), 384).vocab_size == 384
    assert len(list((cache_dir / "tokenizers").glob("*.json"))) == 2


def test_vocab_larger_than_model_names_the_key(small_tokenizer: Tokenizer, tmp_path: Path):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    small_tokenizer.tok.save(str(path))
    with pytest.raises(ValueError, match=r"has 512 tokens but model\.vocab_size=300; set model\.vocab_size=512"):
        build_tokenizer(DataCfg(tokenizer=str(path)), 300)
    # The embedded BPE cannot be smaller than its 256 bytes + 3 specials either.
    with pytest.raises(ValueError, match=r"model\.vocab_size=100"):
        build_tokenizer(DataCfg(), 100)


def test_load_tokenizer_json_from_file_or_folder(small_tokenizer: Tokenizer, tmp_path: Path):
    folder = tmp_path / "tok"
    folder.mkdir()
    small_tokenizer.tok.save(str(folder / "tokenizer.json"))
    for spec in (folder, folder / "tokenizer.json"):
        tok = build_tokenizer(DataCfg(tokenizer=str(spec)), 1024)
        assert tok.identity == small_tokenizer.identity
        assert tok.encode(TEXT) == small_tokenizer.encode(TEXT)
        assert tok.eos_id == small_tokenizer.eos_id


def test_specials_of_other_tokenizers(tmp_path: Path):
    # A GPT-2-style tokenizer: only <|endoftext|>, which then also pads; BOS absent.
    tok = tokenizer_lib.train_bpe(["hello world " * 50], 300)
    raw = json.loads(tok.to_str())
    for added in raw["added_tokens"]:
        added["content"] = {BOS: "<unused0>", EOS: "<|endoftext|>", PAD: "<unused1>"}[added["content"]]
    raw["model"]["vocab"] = {
        {BOS: "<unused0>", EOS: "<|endoftext|>", PAD: "<unused1>"}.get(k, k): v
        for k, v in raw["model"]["vocab"].items()
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    loaded = build_tokenizer(DataCfg(tokenizer=str(tmp_path)), 300)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (None, 1, 1)
    # tokenizer_config.json beside it names the specials explicitly (HF's convention).
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<unused0>",
                                                                "eos_token": {"content": "<unused1>"}}))
    loaded = build_tokenizer(DataCfg(tokenizer=str(tmp_path)), 300)
    assert (loaded.bos_id, loaded.eos_id) == (0, 2)


def test_missing_or_invalid_tokenizer_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer '.*nowhere' not found.*tokenizer\.json"):
        build_tokenizer(DataCfg(tokenizer=str(tmp_path / "nowhere")), 1000)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError,
                       match=r"data\.tokenizer '.*tokenizer\.json' is not a valid HF tokenizer\.json") as err:
        build_tokenizer(DataCfg(tokenizer=str(bad)), 1000)
    assert "\n" not in str(err.value)


def test_an_embedded_bpe_smaller_than_the_model_vocab_is_noted(small_corpus: Path):
    tok = build_tokenizer(DataCfg(), 100_000)  # the small corpus runs out of merges long before
    size = tok.vocab_size
    assert SMALL_VOCAB < size < 100_000
    assert tokenizer_lib.embedded_bpe_note(DataCfg(), tok, 100_000) == (
        f"note: the embedded BPE has {size:,} tokens, fewer than model.vocab_size=100,000: the corpus had no more "
        f"merges to learn (more text gives more); the model keeps 100,000 embedding rows, {100_000 - size:,} of them "
        f"no token's (model.vocab_size={size} drops them)")
    # As many as asked, or the user's own tokenizer (a padded embedding is a choice there): nothing to say.
    assert tokenizer_lib.embedded_bpe_note(DataCfg(), tok, size) is None
    assert tokenizer_lib.embedded_bpe_note(DataCfg(tokenizer="tokenizer.json"), tok, 100_000) is None
    assert build_tokenizer(DataCfg(), size).vocab_size == size  # what the note advises gives a BPE of that size
