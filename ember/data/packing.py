"""Documents -> one flat token stream (EOS after each document) -> fixed-length training samples.

Packing documents end to end, with no padding, is how GPT-style pretraining spends every position on
a real token (GPT-2/3, Llama). Where the tokens are kept on disk (the automatic cache, prepared shards)
is prepare.py's business, which builds on this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ember.config_schema import DataConfig
from ember.data import chat, sources
from ember.data.tokenizer import AnyTokenizer

ENCODE_BATCH_DOCS = 256  # documents per encode_batch call: enough to keep every core busy, bounded memory


@dataclass
class TokenStream:
    tokens: np.ndarray  # (num_tokens,) uint16 or uint32, possibly a read-only memory map
    name: str  # the source, for messages
    num_documents: int
    skipped: list[str] = field(default_factory=list)  # files left out because they are not UTF-8
    # SFT: 1 where the token is a training target (response and EOS), 0 for prompt tokens; None: all are.
    loss_mask: Optional[np.ndarray] = None


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids < 65536: half the disk and page cache of uint32 for every vocab up to 64k."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_documents(texts: list[str], tokenizer: AnyTokenizer) -> np.ndarray:
    """Encode in batches and concatenate, with tokenizer.eos_id after every document."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for start in range(0, len(texts), ENCODE_BATCH_DOCS):
        for ids in tokenizer.encode_batch(texts[start : start + ENCODE_BATCH_DOCS]):
            pieces += [np.asarray(ids, dtype=dtype), eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def tokenize_prompted(prompts: list[str], responses: list[str],
                      tokenizer: AnyTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """SFT documents: prompt + response + EOS each, and a loss mask that is 0 on the prompt tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    tokens: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    for start in range(0, len(prompts), ENCODE_BATCH_DOCS):
        batch_p = tokenizer.encode_batch(prompts[start : start + ENCODE_BATCH_DOCS])
        batch_r = tokenizer.encode_batch(responses[start : start + ENCODE_BATCH_DOCS])
        for p, r in zip(batch_p, batch_r):
            tokens.append(np.asarray(p + r + [tokenizer.eos_id], dtype=dtype))
            mask.append(np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)]))
    if not tokens:
        return np.zeros(0, dtype), np.zeros(0, np.uint8)
    return np.concatenate(tokens), np.concatenate(mask)


def document_pieces(docs: sources.Documents, tokenizer: AnyTokenizer,
                    template: Optional[chat.ChatTemplate] = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, loss mask) of each document, EOS included: for padding them one per sample."""
    if docs.conversations is not None:
        if template is None:
            raise ValueError("chat documents need their chat template")
        return chat.encode_conversations(docs.conversations, tokenizer, template, token_dtype(tokenizer.vocab_size))
    dtype = token_dtype(tokenizer.vocab_size)
    pieces = []
    for start in range(0, docs.num_documents, ENCODE_BATCH_DOCS):
        texts = tokenizer.encode_batch(docs.texts[start : start + ENCODE_BATCH_DOCS])
        prompts = (tokenizer.encode_batch(docs.prompts[start : start + ENCODE_BATCH_DOCS])
                   if docs.prompts is not None else [[] for _ in texts])
        for p, r in zip(prompts, texts):
            pieces.append((np.asarray(p + r + [tokenizer.eos_id], dtype=dtype),
                           np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)])))
    return pieces


def pad_pieces(pieces: list[tuple[np.ndarray, np.ndarray]], width: int,
               pad_id: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One document per `width` tokens (data.packing=false): cut to width, padded with pad_id under mask 0, so
    pack(tokens, width - 1) gives one document per sample. A document left with no target after the cut
    trains nothing and is dropped. Returns (tokens, mask, documents kept)."""
    kept = [(t[:width], m[:width]) for t, m in pieces if m[1:width].any()]  # m[0] is never a label
    dtype = pieces[0][0].dtype if pieces else np.uint32
    tokens = np.full((len(kept), width), pad_id, dtype=dtype)
    mask = np.zeros((len(kept), width), np.uint8)
    for row, (t, m) in enumerate(kept):
        tokens[row, : len(t)], mask[row, : len(m)] = t, m
    return tokens.reshape(-1), mask.reshape(-1), len(kept)


def tokenize_source(data_cfg: DataConfig, tokenizer: AnyTokenizer, split: str,
                    template: Optional[chat.ChatTemplate] = None, pad_to: Optional[int] = None) -> TokenStream:
    """Read one split of the configured source and tokenize it (no cache: see prepare.token_stream).

    Chat documents are rendered with `template` (chat.load_template). pad_to: one document per pad_to
    tokens (data.packing=false), instead of packed end to end."""
    docs = sources.load_documents(data_cfg, split)
    if docs.conversations is not None and template is None:
        template = chat.load_template(getattr(data_cfg, "chat_template", None), tokenizer)
    if pad_to is not None:
        tokens, mask, kept = pad_pieces(document_pieces(docs, tokenizer, template), pad_to, tokenizer.pad_id)
        return TokenStream(tokens, docs.name, kept, docs.skipped, loss_mask=mask)
    if docs.conversations is not None:
        pieces = document_pieces(docs, tokenizer, template)
        return TokenStream(np.concatenate([t for t, _ in pieces]), docs.name, len(pieces), docs.skipped,
                           loss_mask=np.concatenate([m for _, m in pieces]))
    if docs.prompts is not None:
        tokens, mask = tokenize_prompted(docs.prompts, docs.texts, tokenizer)
        return TokenStream(tokens, docs.name, len(docs.texts), docs.skipped, loss_mask=mask)
    return TokenStream(tokenize_documents(docs.texts, tokenizer), docs.name, len(docs.texts), docs.skipped)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(num_tokens,) -> (num_samples, seq_len + 1): consecutive, non-overlapping windows, the tail dropped.

    A view, not a copy, so a memory-mapped stream stays on disk until a batch reads its rows.
    Row i gives inputs row[:-1] and labels row[1:].
    """
    window = seq_len + 1
    num_samples = len(tokens) // window
    return tokens[: num_samples * window].reshape(num_samples, window)
