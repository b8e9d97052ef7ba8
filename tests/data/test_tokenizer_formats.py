"""SentencePiece and tiktoken (Llama 3 format) tokenizers behind the same interface, built locally, and
`ember data tokenizer train`."""

import base64
import json
from pathlib import Path

import pytest
import sentencepiece as spm
from data_testing import DataCfg

from ember.data.tokenizer import (
    LLAMA3_NUM_SPECIAL,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    load_tokenizer,
)
from tests.helpers import run_ember

TEXT = "The quick brown fox jumps over the lazy dog. Café, naïve: 42 + 7 = 49!\nsecond line"
CORPUS = [f"{TEXT} {i} " * 3 for i in range(200)] + ["pack my box with five dozen liquor jugs"] * 50


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(out / "tok"), vocab_size=400, model_type="bpe",
        bos_id=1, eos_id=2, pad_id=3, unk_id=0, byte_fallback=True, minloglevel=2, num_threads=1,
    )
    return out / "tok.model"


def _tiktoken_file(path: Path) -> Path:
    """A tiny Llama 3-format BPE file: the 256 bytes, then a few merges (rank order = merge order)."""
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"qu", b"ick", b"ox"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


def test_sentencepiece_round_trip_and_specials(spm_model: Path):
    tok = load_tokenizer(str(spm_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 3, 400)
    text = TEXT.replace("\n", " ")  # SentencePiece's normaliser folds newlines into spaces
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "jugs"]) == [ids, tok.encode("jugs")]
    (spm_model.parent / "tokenizer.model").write_bytes(spm_model.read_bytes())
    assert load_tokenizer(str(spm_model.parent)).identity == tok.identity  # a folder holding tokenizer.model


def test_tiktoken_llama3_format(tmp_path: Path):
    path = _tiktoken_file(tmp_path / "tokenizer.model")
    tok = load_tokenizer(str(path))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == 263 + LLAMA3_NUM_SPECIAL
    assert (tok.bos_id, tok.eos_id) == (263, 264)  # Llama 3: 128000, 128001 after its 128000 ranks
    ids = tok.encode("the quick fox")
    assert tok.decode(ids) == "the quick fox"
    assert 258 in ids and 260 in ids  # merges applied: "the", "qu"
    assert tok.eos_id not in tok.encode("text quoting <|end_of_text|> stays text")
    assert tok.encode_batch(["the", "ox"]) == [tok.encode("the"), tok.encode("ox")]
    assert tok.decode([*ids, tok.eos_id], skip_special_tokens=True) == "the quick fox"


def test_bad_tokenizer_files_are_named(tmp_path: Path, spm_model: Path):
    broken = tmp_path / "broken.model"
    broken.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ValueError, match=r"broken\.model' is not a valid SentencePiece model"):
        load_tokenizer(str(broken))
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer '.*missing' not found.*unset data.tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"--tokenizer '.*missing' not found: .*; fix the path$") as err:
        load_tokenizer(str(tmp_path / "missing"), "--tokenizer")  # a command's option: no config key named
    assert "data.tokenizer" not in str(err.value)
    with pytest.raises(ValueError, match=r"has 400 tokens but model\.vocab_size=100"):
        build_tokenizer(DataCfg(tokenizer=str(spm_model)), 100)


@pytest.mark.slow
def test_cli_trains_a_tokenizer_json(tmp_path: Path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"{line} {i}"}) + "\n" for i, line in enumerate(CORPUS[:120])))
    out = tmp_path / "tok"
    run_ember("data", "tokenizer", "train", str(data), str(out), "--vocab-size", "300", timeout=300, expect=0)
    tok = load_tokenizer(str(out))
    assert tok.vocab_size <= 300 and tok.decode(tok.encode(TEXT)) == TEXT
    proc = run_ember("data", "tokenizer", "train", str(tmp_path / "nope.jsonl"), str(out), "--vocab-size", "300",
                     timeout=300, expect=2)
    assert proc.stderr.strip() == f"error: SOURCE path '{tmp_path / 'nope.jsonl'}' does not exist; check the path"
