"""Text generation with a KV cache: prefill the prompts in one forward, then decode one token per step.

Every family works unchanged: the attention modules take a preallocated `KVCache` (ember/nn/attention.py)
from outside, RoPE and learned positions come from the positions passed to the model, and a MoE layer
routes each new token as it comes. Prompts of different lengths share a batch right-aligned: each row's
left padding is masked out of attention and its positions start at 0 on its first real token.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ember.errors import ConfigError
from ember.nn.attention import KVCache

if TYPE_CHECKING:
    from ember.data.tokenizer import AnyTokenizer


@dataclasses.dataclass
class Generation:
    prompt: str
    completion: str
    token_ids: list[int]  # the generated ids only (the stop string or EOS that ended it excluded)
    stop_reason: str  # "eos", "stop" (a stop string), or "length"


def tokenizer_for(path: Union[str, Path], spec: Optional[str] = None) -> AnyTokenizer:
    """The tokenizer of the model at `path`: `spec` when given (a tokenizer.json, SentencePiece or tiktoken
    file), else the one its training run used (the run's config.yaml: data.tokenizer, or the embedded BPE of
    the model's vocabulary), or the tokenizer.json / tokenizer.model in the model's directory (an HF directory's,
    or the files `ember convert` copies beside an ember checkpoint it writes). A URL (the model's or `spec`) is
    read through its local copy (ember/storage/cache.py), which keeps a run's config.yaml beside its checkpoint."""
    import yaml

    from ember.data.tokenizer import embedded_tokenizer, load_tokenizer, torch_file_without_tokenizer
    from ember.model_io.model_meta import MODEL_JSON, read_model_json
    from ember.storage.cache import local_copy

    if spec:
        return load_tokenizer(str(local_copy(spec, "--tokenizer")), "--tokenizer")
    path = local_copy(path)
    if path.is_file():  # a torch file: it names no tokenizer
        raise torch_file_without_tokenizer(path)
    # An HF directory's own, or the one `ember convert` copies beside the checkpoint it writes
    if path.is_dir() and any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return load_tokenizer(str(path))
    run = path if (path / "config.yaml").is_file() else path.parent.parent  # a run, or its checkpoints/step-N
    step = path if (path / MODEL_JSON).is_file() else None
    if step is None and (run / "checkpoints").is_dir():
        steps = sorted(run.glob(f"checkpoints/step-*/{MODEL_JSON}"), key=lambda p: int(p.parent.name[5:]))
        step = steps[-1].parent if steps else None
    if not (run / "config.yaml").is_file() or step is None:
        raise ConfigError(f"no tokenizer is known for '{path}' (no run config.yaml or tokenizer.json beside it); "
                          "pass --tokenizer FILE")
    data = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("data", {})
    if data.get("tokenizer"):
        return load_tokenizer(data["tokenizer"])
    vocab = read_model_json(step / MODEL_JSON)[2].vocab_size
    return embedded_tokenizer(vocab, data.get("val_fraction", 0.02))


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_cache") and (hasattr(m, "wk") or hasattr(m, "make_kv_cache"))]


def attach_kv_caches(model: nn.Module, batch: int, max_len: int,
                     dtype: Optional[torch.dtype] = None) -> list[KVCache]:
    """Give every attention module of `model` a cache for `batch` rows of up to `max_len` positions: its own
    `make_kv_cache(batch, max_len, dtype, device)` where it has one, else a KVCache. dtype: the cache's (None: the
    parameters'; under autocast the compute dtype, so that attention reads the cache without a cast)."""
    caches = []
    param = next(model.parameters())
    dtype = dtype or param.dtype
    for attention in _attention_modules(model):
        if hasattr(attention, "make_kv_cache"):  # a cache of its own form (MLA's latent: nn/mla.py)
            attention.use_kv_cache(attention.make_kv_cache(batch, max_len, dtype, param.device))
            caches.append(attention.kv_cache)
            continue
        head_dim = attention.head_dim
        kv_heads = attention.wk.weight.shape[0] // head_dim
        # Under tensor parallelism (a sharded model, ember.eval.distributed) this rank computes only its share of
        # the heads: wk is a DTensor over a mesh with a "tensor" dimension, split over output features.
        mesh = getattr(attention.wk.weight, "device_mesh", None)
        if mesh is not None and "tensor" in (mesh.mesh_dim_names or ()):
            kv_heads //= mesh.size(mesh.mesh_dim_names.index("tensor"))
        attention.use_kv_cache(KVCache(batch, kv_heads, max_len, head_dim, dtype, param.device))
        caches.append(attention.kv_cache)
    return caches


def detach_kv_caches(model: nn.Module) -> None:
    for attention in _attention_modules(model):
        attention.use_kv_cache(None)


def sampling_temperature(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float],
                         seed: Optional[int], stop: Sequence[str] = ()) -> float:
    """The temperature a generation runs at, its options checked: unset, 1.0 when top_k, top_p or seed ask for
    sampling, else 0 (greedy). Out-of-range values, and sampling options beside an explicit temperature 0
    (greedy would ignore them), are one-line errors: each would otherwise change the output without a word."""
    sampling = [name for name, value in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if value is not None]
    if temperature is None:
        temperature = 1.0 if sampling else 0.0
    if not math.isfinite(temperature):  # nan fails every comparison below; inf would sample uniformly
        raise ConfigError(f"temperature={temperature} must be a finite number >= 0 (0: greedy, 1: the model's own "
                          "distribution)")
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0: greedy, 1: the model's own distribution)")
    if temperature == 0 and sampling:
        raise ConfigError(f"temperature=0 decodes greedily, so {' and '.join(sampling)} would have no effect; drop "
                          "the temperature to sample (at 1.0), or give a temperature above 0")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k={top_k} must be >= 1 (the number of most likely tokens sampled from); "
                          "leave it out to sample from every token")
    if top_p is not None and not 0 < top_p <= 1:  # nan too: it fails both comparisons
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (the probability mass sampled from; 1 keeps every token)")
    if any(s == "" for s in stop):
        raise ConfigError("a stop string is empty: it would end every completion before its first token; "
                          "give the text to stop at")
    return float(temperature)


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")


def prompt_ids(model: nn.Module, tokenizer: AnyTokenizer, prompts: Sequence[Union[str, Sequence[int]]],
               max_new_tokens: int) -> list[list[int]]:
    """The token ids of each prompt, checked to fit the model with `max_new_tokens` more: what generate() checks
    before any work, callable on its own so that `ember generate` refuses before it prints anything."""
    check_max_new_tokens(max_new_tokens)
    ids = [list(p) if not isinstance(p, str) else tokenizer.encode(p) for p in prompts]
    if not ids or any(len(row) == 0 for row in ids):
        raise ConfigError("every prompt needs at least one token")
    limit = model.args.max_seq_len
    longest = max(len(row) for row in ids)
    if longest + max_new_tokens > limit:
        raise ConfigError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                          f"max_seq_len={limit}; shorten the prompt or lower max_new_tokens")
    return ids


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next tokens (B,) from the last position's logits (B, V): greedy at temperature 0, else sampled from
    the softmax of logits / temperature restricted to the top_k tokens and to the top_p probability mass."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if probs.device.type == "cpu":
        # torch.multinomial on a CPU draws a random number per vocabulary entry (a third of a small model's decode
        # step); the inverse of the cumulative distribution at one uniform draw per row samples the same
        # distribution, and a token of probability 0 is never the first whose cumulative sum passes the draw.
        cdf = probs.cumsum(dim=-1)
        draw = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
        return torch.searchsorted(cdf, draw, right=True).clamp_max(probs.shape[-1] - 1).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: nn.Module, tokenizer: AnyTokenizer, prompts: Sequence[Union[str, Sequence[int]]], *,
             max_new_tokens: int = 64, temperature: Optional[float] = None, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: Optional[int] = None, stop: Sequence[str] = (),
             stop_at_eos: bool = True, on_text: Optional[Callable[[int, str], None]] = None,
             compile: bool = False, all_done: Optional[Callable[[bool], bool]] = None,
             cache_dtype: Optional[torch.dtype] = None, cache_len: Optional[int] = None) -> list[Generation]:
    """Continue each prompt (text, or token ids) by up to `max_new_tokens` tokens. Greedy at temperature 0, the
    default unless top_k, top_p or seed is given (then temperature 1.0; see sampling_temperature).
    Stops a row at EOS or at any `stop` string (cut from the completion). `on_text(row, piece)` receives the
    new text of a row as it is decoded (for streaming). compile=True runs the decode step through
    torch.compile with static shapes (the cache attended whole, under a mask): one compilation, then no
    Python between the kernels of a step; worth it for long generations. `all_done(this_rank_done)`: whether every
    rank of a sharded model is done (a collective; ranks whose rows ended keep stepping with the others until
    then, since every forward of a sharded model is collective). cache_dtype: the KV cache's (attach_kv_caches);
    cache_len: the cache's length when longer than the prompts and max_new_tokens need (with compile, one length
    for every call keeps one compiled decode step whatever the prompts' lengths)."""
    temperature = sampling_temperature(temperature, top_k, top_p, seed, stop)
    ids = prompt_ids(model, tokenizer, prompts, max_new_tokens)
    longest = max(len(row) for row in ids)
    device = next(model.parameters()).device
    batch, total = len(ids), max(longest + max_new_tokens, cache_len or 0)
    pad = torch.tensor([longest - len(row) for row in ids], device=device)  # (B,) right-aligned prompts
    tokens = torch.tensor([[0] * (longest - len(row)) + row for row in ids], device=device)  # (B, P)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    caches = attach_kv_caches(model, batch, total, cache_dtype)
    decode_step = model
    if compile:
        for cache in caches:
            cache.static = True
        decode_step = torch.compile(model, dynamic=False)
    out_ids: list[list[int]] = [[] for _ in range(batch)]
    texts, reasons = [""] * batch, [""] * batch
    eos = getattr(tokenizer, "eos_id", None) if stop_at_eos else None
    # The cache's end (slots[-1] + 1) and whether any row is left-padded, kept on the host: read back from the
    # tensors they would cost every layer a device sync at every step.
    end, padded = longest, any(len(row) < longest for row in ids)
    try:
        slots = torch.arange(longest, device=device)  # prefill: every prompt slot at once
        step_tokens = sequence = tokens
        # A model whose RoPE tables change past some length (Phi-3's LongRoPE) recomputes every cached position
        # when the sequence first reaches past it, as transformers' generate does
        switch = getattr(model, "rope_switch_length", None)
        for _ in range(max_new_tokens):
            for cache in caches:
                cache.set_positions(slots, pad, end=end, padded=padded)
            positions = (slots[None, :] - pad[:, None]).clamp_min(0)  # (B, T): each row counts from its first token
            step = decode_step if step_tokens.shape[1] == 1 else model  # the prefill runs eagerly
            logits = step(step_tokens, positions, last_only=True)[:, -1]  # (B, V): all that is sampled from
            next_tokens = _sample(logits, temperature, top_k, top_p, generator)
            for row, token in enumerate(next_tokens.tolist()):
                if reasons[row]:
                    continue
                if eos is not None and token == eos:
                    reasons[row] = "eos"
                    continue
                out_ids[row].append(token)
                if not (stop or on_text):
                    continue  # decoded once at the end: text is needed per token only to stop or stream
                text = tokenizer.decode(out_ids[row])
                hit = next((s for s in stop if s in text), None)
                if hit is not None:
                    text = text[: text.index(hit)]
                    reasons[row] = "stop"
                if on_text is not None and len(text) > len(texts[row]):
                    on_text(row, text[len(texts[row]):])
                texts[row] = text
            if all_done(all(reasons)) if all_done is not None else all(reasons):
                break
            slots, end = slots[-1:] + 1, end + 1  # decode: one new slot per row
            step_tokens = next_tokens[:, None]
            sequence = torch.cat([sequence, step_tokens], dim=1)
            if switch is not None and end - 1 == switch:
                slots, step_tokens = torch.arange(switch + 1, device=device), sequence
    finally:
        detach_kv_caches(model)
        model.train(was_training)
    if not (stop or on_text):
        texts = [tokenizer.decode(ids) for ids in out_ids]
    results = []
    for row, prompt in enumerate(prompts):
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))
        kept = out_ids[row]
        if reasons[row] == "stop":  # the ids of the completion up to the stop string
            while kept and tokenizer.decode(kept) != texts[row] and len(tokenizer.decode(kept)) > len(texts[row]):
                kept = kept[:-1]
        results.append(Generation(prompt_text, texts[row], kept, reasons[row] or "length"))
    return results
