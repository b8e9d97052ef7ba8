"""Tokenizers behind one small interface, and how ember gets one.

Three kinds, each a thin wrapper with the same attributes (source, vocab_size, identity, bos_id,
eos_id, pad_id) and methods (encode, encode_batch, decode):
- `Tokenizer`: a Hugging Face tokenizer.json (Llama 3's, GPT-2's, or ember's own BPE);
- `SentencePieceTokenizer`: a SentencePiece .model (Llama 2's, the Pile/C4 T5 kind);
- `TiktokenTokenizer`: a tiktoken BPE file in Llama 3's format (Meta's original `tokenizer.model`).

`data.tokenizer=None` trains a byte-level BPE (GPT-2's scheme: bytes mapped to printable characters,
so every string encodes and nothing is unknown) on the embedded corpus's train split, once, and
caches it; a path loads any of the three kinds.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ember.config_schema import DataConfig
from ember.constants import default_cache_dir
from ember.data import sources
from ember.errors import ConfigError, DataError, UserFileNotFound, first_error_line

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
# Special tokens of common tokenizer.json files, most specific first (Llama 3, Llama 2/Mistral, GPT-2/NeoX).
BOS_CANDIDATES = (BOS, "<s>", "<|startoftext|>")
EOS_CANDIDATES = (EOS, "</s>", "<|endoftext|>")
PAD_CANDIDATES = (PAD, "<pad>", "<|padding|>", "[PAD]")
# Bump when the training recipe below changes, so old cached tokenizers are not reused.
EMBEDDED_TOKENIZER_VERSION = 1


class Tokenizer:
    """encode/decode plus the ids the data pipeline and generation need."""

    def __init__(self, tok: tokenizers.Tokenizer, source: str, special: Optional[dict[str, str]] = None):
        self.tok = tok
        # Text is data: a document that happens to contain "<|end_of_text|>" must not encode to the
        # real EOS id and cut a sample short. Only packing inserts special ids.
        self.tok.encode_special_tokens = True
        self.source = source  # for messages: a path, or "embedded byte-level BPE"
        special = special or {}
        self.bos_id = self._find(special.get("bos_token"), BOS_CANDIDATES)
        # transformers (and so lm-eval's hf model) knows a tokenizer.json's BOS only from its tokenizer_config.json;
        # one found among the candidates alone (the embedded BPE's, which training never inserts) is not declared
        self.bos_declared = "bos_token" in special and self.bos_id is not None
        self.eos_id = self._find(special.get("eos_token"), EOS_CANDIDATES)
        self.pad_id = self._find(special.get("pad_token"), PAD_CANDIDATES)
        if self.eos_id is None:
            raise DataError(
                f"tokenizer {source} has no end-of-text token (looked for {', '.join(EOS_CANDIDATES)}); "
                "add one as a special token, or set eos_token in a tokenizer_config.json beside it"
            )
        if self.pad_id is None:
            self.pad_id = self.eos_id  # padding is masked out of the loss, so any id serves
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # The json is the whole tokenizer (model, merges, normalizer, specials): its hash keys caches.
        self.identity: str = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]

    def _find(self, preferred: Optional[str], candidates: tuple[str, ...]) -> Optional[int]:
        for token in (preferred, *candidates):
            token_id = self.tok.token_to_id(token) if token else None
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with no BOS/EOS added (packing adds EOS between documents)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once: the Rust encoder spreads them over all cores."""
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets, which we never use.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """ids (a list, or a 1-D tensor/array) -> text."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, vocab_size={self.vocab_size}, identity={self.identity})"


def train_bpe(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE with BOS/EOS/PAD as ids 0, 1, 2 and `vocab_size` entries in all."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even ones the corpus lacks
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def fewer_tokens_note(size: int, asked: int, asked_as: str) -> Optional[str]:
    """Why a BPE trained to `asked` entries has `size`, fewer: its training stops when no pair of tokens in the
    corpus is left to merge. None when it has them all; `asked_as`: how the user asked (`--vocab-size 500`)."""
    if size >= asked:
        return None
    return f"{size:,} tokens, fewer than {asked_as}: the corpus had no more merges to learn (more text gives more)"


def embedded_bpe_note(data_cfg: DataConfig, tok: AnyTokenizer, model_vocab: int) -> Optional[str]:
    """The run header's note for an embedded BPE smaller than model.vocab_size, which the model keeps: the
    embedding rows past the BPE's are no token's. None when it has them all or the tokenizer is the user's (a
    model's vocabulary padded past its tokenizer's is a choice there)."""
    if data_cfg.tokenizer is not None:
        return None
    short = fewer_tokens_note(tok.vocab_size, model_vocab, f"model.vocab_size={model_vocab:,}")
    return short and (f"note: the embedded BPE has {short}; the model keeps {model_vocab:,} embedding rows, "
                      f"{model_vocab - tok.vocab_size:,} of them no token's (model.vocab_size={tok.vocab_size} "
                      "drops them)")


def embedded_tokenizer(vocab_size: int, val_fraction: float, cache_dir: Optional[Path] = None) -> Tokenizer:
    """The BPE trained on the embedded corpus's train split, from the cache when it is there.

    It trains on the whole train split (~30 MB): that takes ~8 s on two cores, so no subset is needed.
    Keyed by corpus fingerprint, vocab size and val_fraction, so the val files never reach the tokenizer.
    """
    name = "embedded byte-level BPE"
    key = sources.short_hash(sources.embedded_fingerprint(), vocab_size, val_fraction, EMBEDDED_TOKENIZER_VERSION)
    path = (cache_dir or default_cache_dir()) / "tokenizers" / f"embedded-bpe-{vocab_size}-{key}.json"
    if path.is_file():
        try:
            return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), name)
        except Exception:  # a cache entry we cannot read is rebuilt, never fatal
            pass
    docs = sources.load_embedded("train", val_fraction)
    tok = train_bpe(docs.texts, vocab_size)
    sources.atomic_write(path, lambda f: f.write(tok.to_str().encode()))
    return Tokenizer(tok, name)


def torch_file_without_tokenizer(path: Path) -> ConfigError:
    """The error for a model given as a torch file (`ember convert --to torch`) with no --tokenizer. It names no
    cached file: the file keeps the model's vocab size only, and the embedded BPE's cache is keyed by corpus,
    vocab size, val_fraction and recipe version, so several cached BPEs of that size may fit and only the run's
    config (or its HF export) says which one it trained with; a guess would give a wrong number."""
    return ConfigError(f"'{path}' is a torch file: it holds no tokenizer and does not say which one its run used; "
                       "give the run directory instead (its tokenizer is known), or --tokenizer FILE with the run's "
                       "data.tokenizer (in its config.yaml), or export the run with `ember convert RUN --to hf`, "
                       "which writes its tokenizer (the embedded BPE too) beside the weights")


class TokenizerLike(Protocol):
    source: str
    vocab_size: int
    identity: str
    bos_id: Optional[int]
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model file (a protobuf: loading it runs no code)."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path, self.source = path, str(path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as err:
            raise DataError(f"data.tokenizer '{path}' is not a valid SentencePiece model "
                            f"({first_error_line(err)}); re-export it") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.sp.eos_id() < 0:
            raise DataError(f"SentencePiece model {path} has no end-of-sentence id (eos_id=-1); retrain it with one")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.identity = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int, num_threads=-1)  # -1: every core

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.sp.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.source}, vocab_size={self.vocab_size})"


# Llama 3's tiktoken setup (Meta's llama3 tokenizer.py): the pre-tokenizer pattern, and 256 special
# tokens after the BPE ranks, of which the first two are BOS and EOS.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
LLAMA3_NAMED_SPECIAL = (BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>")


class TiktokenTokenizer:
    """A tiktoken BPE file (lines of `base64(token) rank`) with Llama 3's pattern and special tokens."""

    def __init__(self, path: Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path, self.source = path, str(path)
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as err:
            raise DataError(f"data.tokenizer '{path}' is not a valid tiktoken BPE file "
                            f"({first_error_line(err)})") from None
        specials = list(LLAMA3_NAMED_SPECIAL) + [
            f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL - 5)
        ]
        special_ids = {token: len(ranks) + i for i, token in enumerate(specials)}
        self.enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special_ids)
        self.vocab_size = len(ranks) + len(specials)
        self.bos_id, self.eos_id = special_ids[BOS], special_ids[EOS]
        self.pad_id = self.eos_id
        self.identity = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        # disallowed_special=(): special-token text in a document is encoded as plain text (data, not control).
        return self.enc.encode(text, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(texts, disallowed_special=())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.vocab_size - LLAMA3_NUM_SPECIAL]
        return self.enc.decode(ids)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.source}, vocab_size={self.vocab_size})"


AnyTokenizer = Union[Tokenizer, SentencePieceTokenizer, TiktokenTokenizer]
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+\r?$")


def _is_tiktoken_file(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096)
    lines = head.split(b"\n")
    if len(head) == 4096:
        lines = lines[:-1]  # the last line may be cut off by the read
    lines = [line for line in lines[:20] if line]
    return bool(lines) and all(_TIKTOKEN_LINE.match(line) for line in lines)


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> AnyTokenizer:
    """A tokenizer.json, a SentencePiece .model, a tiktoken BPE file (Llama 3's `tokenizer.model`), or a
    folder holding one of them (tokenizer.json first); a tokenizer_config.json beside a tokenizer.json
    may name its special tokens. `key`: what named it, for the error (a config key or a command's option)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        found = [path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()]
        path = found[0] if found else path / "tokenizer.json"
    if not path.is_file():
        fix = "fix the path or unset data.tokenizer to use the embedded BPE" if key == "data.tokenizer" else \
            "fix the path"
        raise UserFileNotFound(
            f"{key} '{spec}' not found: expected a tokenizer.json, a SentencePiece .model, a tiktoken "
            f"BPE file, or a folder containing one; {fix}"
        )
    if path.suffix != ".json":
        return TiktokenTokenizer(path) if _is_tiktoken_file(path) else SentencePieceTokenizer(path)
    return _load_hf_tokenizer(path)


def _load_hf_tokenizer(path: Path) -> Tokenizer:
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:
        raise DataError(f"data.tokenizer '{path}' is not a valid HF tokenizer.json "
                        f"({first_error_line(err)}); re-export it") from None
    special: dict[str, str] = {}
    config_path = path.parent / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            config = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value  # older files nest it
            if isinstance(value, str):
                special[key] = value
    return Tokenizer(tok, str(path), special)


def build_tokenizer(data_cfg: DataConfig, vocab_size: int, cache_dir: Optional[Path] = None) -> AnyTokenizer:
    """The run's tokenizer (see the module docstring); its vocabulary must fit the model's embedding."""
    if getattr(data_cfg, "messages_field", None):
        from ember.data.chat import check_chat_source  # local: only chat data needs it

        check_chat_source(data_cfg)
    if data_cfg.tokenizer is None:
        tok = embedded_tokenizer(vocab_size, data_cfg.val_fraction, cache_dir)
    else:
        tok = load_tokenizer(data_cfg.tokenizer)
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer {tok.source} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={tok.vocab_size} or larger"
        )
    return tok
