"""The training data loader: stateful, sharded over data-parallel ranks, prefetching in the background.

Sample order. Samples are visited in a permutation seeded by (seed, epoch). One *global* cursor counts
the samples of the epoch that all ranks together have consumed; global batch k is the slice
perm[k*mb*W : (k+1)*mb*W] and rank r takes its r-th micro-batch of it:

    rank r, global batch k  ->  perm[k*mb*W + r*mb : k*mb*W + (r+1)*mb]      (mb: micro-batch, W: dp world)

So ranks read disjoint samples, and the state {epoch, cursor} means the same for any number of ranks:
a run resumed on a different W carries on through the same global order. When the next global batch
no longer fits in the epoch, the tail (< mb*W samples) is dropped and the next epoch's permutation
starts, on every rank at once.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Union, runtime_checkable

import numpy as np
import torch

from ember.config_schema import DataConfig
from ember.constants import IGNORE_INDEX
from ember.data import packing, prepare, sources
from ember.data.prefetch import Prefetcher
from ember.data.tokenizer import AnyTokenizer
from ember.errors import DataError


@functools.lru_cache(maxsize=4)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    # SeedSequence mixes (seed, epoch) into independent streams; cached because every batch needs it.
    return np.random.default_rng([seed % 2**64, epoch]).permutation(num_samples)


@dataclass
class PackedSamples:
    """Rows of a packed token stream: sample i is rows[i], seq_len + 1 tokens."""

    rows: np.ndarray  # (num_samples, seq_len + 1), possibly a memory map
    mask_rows: Optional[np.ndarray] = None  # the same shape: 1 where a token is a training target (SFT)

    @property
    def num_samples(self) -> int:
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return self.rows.shape[1] - 1

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rows (n, seq_len + 1) and their loss mask (None: every token counts)."""
        mask = None if self.mask_rows is None else torch.from_numpy(self.mask_rows[indices].astype(np.bool_))
        return torch.from_numpy(self.rows[indices].astype(np.int64)), mask


@dataclass
class SyntheticSamples:
    """Uniform random tokens; sample j is drawn from a generator seeded by (seed, split, j).

    Seeding per global sample index (rather than per rank and step) gives synthetic data the same
    rank-count-independent order as real data, at the cost of one cheap manual_seed per sample.
    """

    vocab_size: int
    seq_len: int
    seed: int
    split: str
    num_samples = None  # infinite: no epochs, no permutation

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rows = []
        for j in indices.tolist():
            mixed = np.random.SeedSequence([self.seed % 2**64, sources.SPLITS.index(self.split), j])
            gen = torch.Generator().manual_seed(int(mixed.generate_state(1, np.uint64)[0] >> 1))
            rows.append(torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen))
        return torch.stack(rows), None  # (n, seq_len + 1)


class MixtureSamples:
    """A weighted mixture of packed sources, indexed by global sample number j = 0, 1, 2, ...

    Sample j's source is drawn from the weights by a generator seeded with (seed, block of j), so the
    choice depends on j alone; its row is the next unread one of that source, in the source's own
    seeded permutation, and a source that runs dry starts its next epoch (a new permutation) while the
    others go on. Everything is a function of j, so resuming at a cursor, on any number of ranks,
    continues the same sequence; reaching a cursor costs one pass over the choices before it (blocks
    of 8192, cached: about a millisecond per million samples).
    """

    BLOCK = 8192
    num_samples = None  # no global epoch: the mixture is an endless stream

    def __init__(self, parts: list[PackedSamples], weights: list[float], names: list[str], seed: int):
        total = float(sum(weights))
        self.parts, self.names, self.seed = parts, names, seed
        self.probs = np.array([w / total for w in weights])
        self.seq_len = parts[0].seq_len
        self._counts_before: list[np.ndarray] = [np.zeros(len(parts), dtype=np.int64)]  # per block, cumulative
        self._block_cache: dict[int, np.ndarray] = {}
        self._lock = threading.RLock()  # the prefetch thread and the trainer's logging both read the caches

    def _choices(self, block: int) -> np.ndarray:
        with self._lock:
            return self._choices_locked(block)

    def _choices_locked(self, block: int) -> np.ndarray:
        if block not in self._block_cache:
            if len(self._block_cache) > 64:
                self._block_cache.clear()
            rng = np.random.default_rng([self.seed % 2**64, 0x6D6978, block])  # 0x6D6978: "mix"
            self._block_cache[block] = rng.choice(len(self.parts), size=self.BLOCK, p=self.probs)
        return self._block_cache[block]

    def _counts_at_block(self, block: int) -> np.ndarray:
        with self._lock:
            return self._counts_at_block_locked(block)

    def _counts_at_block_locked(self, block: int) -> np.ndarray:
        while len(self._counts_before) <= block:
            b = len(self._counts_before) - 1
            step = np.bincount(self._choices(b), minlength=len(self.parts))
            self._counts_before.append(self._counts_before[-1] + step)
        return self._counts_before[block]

    def source_counts(self, end: int) -> dict[str, int]:
        """How many of the samples 0..end-1 each source supplied."""
        block, offset = divmod(end, self.BLOCK)
        counts = self._counts_at_block(block) + np.bincount(self._choices(block)[:offset], minlength=len(self.parts))
        return {name: int(c) for name, c in zip(self.names, counts)}

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        rows, masks = [], []
        with_mask = any(part.mask_rows is not None for part in self.parts)
        for j in indices.tolist():
            block, offset = divmod(j, self.BLOCK)
            choices = self._choices(block)
            source = int(choices[offset])
            k = int(self._counts_at_block(block)[source] + np.count_nonzero(choices[:offset] == source))
            part = self.parts[source]
            epoch, within = divmod(k, part.num_samples)
            row = epoch_permutation(part.num_samples, self.seed + 1 + source, epoch)[within]
            rows.append(part.rows[row].astype(np.int64))
            if with_mask:
                masks.append(part.mask_rows[row] if part.mask_rows is not None else np.ones(self.seq_len + 1, np.uint8))
        mask = torch.from_numpy(np.stack(masks).astype(np.bool_)) if with_mask else None
        return torch.from_numpy(np.stack(rows)), mask  # (n, seq_len + 1) each


Samples = Union[PackedSamples, SyntheticSamples, MixtureSamples]
Batch = tuple[torch.Tensor, torch.Tensor, int, int]  # inputs, labels, and the (epoch, cursor) after it


def make_batch(samples: Samples, seed: int, mb: int, dp_rank: int, dp_world: int, epoch: int, cursor: int) -> Batch:
    """This rank's micro-batch at the global position (epoch, cursor), and the position after it."""
    step = mb * dp_world
    if samples.num_samples is None:
        indices = np.arange(cursor + dp_rank * mb, cursor + (dp_rank + 1) * mb)
    else:
        if cursor + step > samples.num_samples:  # this global batch does not fit: next epoch
            epoch, cursor = epoch + 1, 0
        perm = epoch_permutation(samples.num_samples, seed, epoch)
        indices = perm[cursor + dp_rank * mb : cursor + (dp_rank + 1) * mb]
    rows, mask = samples.get(indices)  # (mb, seq_len + 1) each
    labels = rows[:, 1:].clone()
    if mask is not None:
        labels[~mask[:, 1:]] = IGNORE_INDEX  # prompt tokens are read, not trained on
    return rows[:, :-1].contiguous(), labels, epoch, cursor + step


def _batches_from(make: Callable[[int, int], Batch], epoch: int, cursor: int) -> Callable[[], Batch]:
    """make_batch's successive batches from (epoch, cursor) on, one per call. Holds no loader, so a prefetch
    thread running it does not keep the loader alive."""
    position = [epoch, cursor]

    def next_batch() -> Batch:
        batch = make(*position)
        position[:] = batch[2], batch[3]
        return batch

    return next_batch


@runtime_checkable
class TrainLoader(Protocol):
    """What the trainer uses of a data loader. TokenLoader (packed, synthetic, mixture and DPO pair samples) and
    the streaming StreamLoader are one: batches of (inputs, labels), (micro_batch_size, seq_len) each, forever,
    and a state that is the position the caller has consumed (a checkpoint's "data")."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def reset(self) -> None: ...  # back to the first batch: every evaluation reads the same validation batches
    def close(self) -> None: ...  # stop the prefetch thread
    def describe(self) -> str: ...  # one line for the run's header: the source, the split, its size
    def mixture_counts(self) -> Optional[dict[str, int]]: ...  # samples taken from each source of a mixture


class TokenLoader:
    """An infinite iterator of (inputs, labels), each a LongTensor (micro_batch_size, seq_len).

    state_dict() describes what the caller has *consumed*, not what the prefetch thread has made ahead:
    after load_state_dict(), the next batch is the one an uninterrupted run would have returned.
    """

    def __init__(
        self,
        samples: Samples,
        *,
        name: str,
        split: str,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        num_workers: int = 1,
        prefetch: int = 4,
        num_tokens: Optional[int] = None,
        skipped: Optional[list[str]] = None,
    ):
        if not 0 <= dp_rank < dp_world:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        self.samples, self.name, self.split = samples, name, split
        self.micro_batch_size, self.dp_rank, self.dp_world, self.seed = micro_batch_size, dp_rank, dp_world, seed
        self.num_tokens, self.num_samples = num_tokens, samples.num_samples
        self.skipped = skipped or []
        # 0: batches are made in the training thread; 1: one prefetch thread (ember/data/prefetch.py).
        self.num_workers, self.prefetch = num_workers, max(prefetch, 1)
        self.epoch, self.cursor = 0, 0  # consumed position
        self._make = functools.partial(make_batch, samples, seed, micro_batch_size, dp_rank, dp_world)
        self._prefetcher: Optional[Prefetcher] = None

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(_batches_from(self._make, self.epoch, self.cursor), depth=self.prefetch,
                                          name=f"ember-data-{self.split}-rank{self.dp_rank}",
                                          threaded=self.num_workers > 0)
        try:
            inputs, labels, epoch, cursor = self._prefetcher.get()
        except BaseException:
            self._shutdown()  # the next call retries from the consumed position
            raise
        self.epoch, self.cursor = epoch, cursor
        return inputs, labels

    def _shutdown(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        """Stop the prefetch thread (also done when the loader is garbage collected)."""
        self._shutdown()

    def __del__(self) -> None:
        self._shutdown()

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; batches prefetched from the old position are discarded."""
        self._shutdown()
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def reset(self) -> None:
        """Back to the first batch (e.g. so every evaluation reads the same validation batches)."""
        self.load_state_dict({"epoch": 0, "cursor": 0})

    def mixture_counts(self) -> Optional[dict[str, int]]:
        """For a mixture: samples consumed so far from each source (all ranks together); else None."""
        if not isinstance(self.samples, MixtureSamples):
            return None
        return self.samples.source_counts(self.cursor)

    def describe(self) -> str:
        if isinstance(self.samples, MixtureSamples):
            return f"{self.name} ({self.split}): {self.num_tokens:,} tokens, endless weighted stream"
        if self.num_samples is None:
            return f"{self.name} ({self.split}): random tokens, infinite"
        seq = self.samples.seq_len
        text = f"{self.name} ({self.split}): {self.num_tokens:,} tokens, {self.num_samples:,} samples of {seq}+1"
        if self.skipped:
            text += f", {len(self.skipped)} file(s) skipped as not UTF-8"
        return text


def _check_chat_documents(data_cfg: DataConfig, stream: packing.TokenStream, tokenizer: AnyTokenizer,
                          pad_to: Optional[int]) -> None:
    """Document masking ends a document at every EOS. A chat template that writes the EOS token inside a
    conversation (an instruct tokenizer whose eos_token is its end-of-turn marker, e.g. Llama 3's <|eot_id|>)
    would cut each conversation into turns that cannot see each other: refused, not trained wrongly."""
    if not (getattr(data_cfg, "messages_field", None) and getattr(data_cfg, "document_mask", False)) or pad_to:
        return
    if np.count_nonzero(np.asarray(stream.tokens) == tokenizer.eos_id) > stream.num_documents:
        eos = tokenizer.decode([tokenizer.eos_id])
        raise DataError(f"the chat template writes the tokenizer's EOS {eos} inside conversations, and "
                        "data.document_mask ends a document at every EOS; set data.document_mask=false, or "
                        "data.packing=false, or an end-of-text eos_token in the tokenizer's tokenizer_config.json")


def build_loader(
    data_cfg: DataConfig,
    tokenizer: Optional[AnyTokenizer],
    *,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
    split: str = "train",
    vocab_size: Optional[int] = None,
    cache_dir: Optional[Path] = None,
) -> TrainLoader:
    """The loader of one split ("train" or "val") of data_cfg.dataset for this data-parallel rank."""
    if seq_len <= 0 or micro_batch_size <= 0:
        raise DataError(f"seq_len={seq_len} and micro_batch_size={micro_batch_size} must be positive")
    common = dict(
        split=split,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        seed=seed,
        num_workers=data_cfg.num_workers,
        prefetch=data_cfg.prefetch,
    )
    if getattr(data_cfg, "streaming", False):
        from ember.data.stream import build_stream_loader

        return build_stream_loader(data_cfg, tokenizer, split=split, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                   dp_rank=dp_rank, dp_world=dp_world, seed=seed)
    if data_cfg.dataset == sources.SYNTHETIC:
        vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer else None)
        if not vocab_size:
            raise DataError("data.dataset=synthetic needs a vocab_size (the model's model.vocab_size)")
        samples = SyntheticSamples(vocab_size, seq_len, seed, split)
        return TokenLoader(samples, name="synthetic", **common)  # type: ignore[arg-type]

    if tokenizer is None:
        raise DataError(f"data.dataset '{data_cfg.dataset}' needs a tokenizer (build_tokenizer); got None")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={tokenizer.vocab_size} or larger"
        )
    # data.packing=false: each document is padded to one sample when tokenized (packing.pad_pieces), so the
    # samples, their order and the loader's (epoch, cursor) state work exactly as for packed data.
    pad_to = None if getattr(data_cfg, "packing", True) else seq_len + 1
    mixture = getattr(data_cfg, "mixture", None)
    if mixture:
        parts, names, num_tokens, skipped = [], [], 0, []
        for i, item in enumerate(mixture):
            part_cfg = dataclasses.replace(data_cfg, dataset=item.source, mixture=[],
                                           text_field=item.text_field or data_cfg.text_field,
                                           config=item.config or data_cfg.config)
            try:
                stream = prepare.token_stream(part_cfg, tokenizer, split, cache_dir, pad_to)
                _check_chat_documents(part_cfg, stream, tokenizer, pad_to)
            except DataError as err:  # point at this source's own key, which overrides the global one
                raise DataError(str(err).replace(
                    "set data.text_field", f"set data.mixture[{i}].text_field "
                    "(this source's text column; data.text_field is every source's default)")) from None
            rows = packing.pack(stream.tokens, seq_len)
            mask_rows = packing.pack(stream.loss_mask, seq_len) if stream.loss_mask is not None else None
            if len(rows) == 0:
                raise DataError(
                    f"data.mixture[{i}] '{item.source}' ({split} split) has {len(stream.tokens):,} tokens, not one "
                    f"sample of seq_len+1={seq_len + 1}; lower seq_len, add data, or drop it from the mixture"
                )
            parts.append(PackedSamples(rows, mask_rows))
            names.append(item.source)
            num_tokens += len(stream.tokens)
            skipped += stream.skipped
        samples = MixtureSamples(parts, [item.weight for item in mixture], names, seed)
        name = "mixture of " + ", ".join(f"{n} ({w:.0%})" for n, w in zip(names, samples.probs))
        return TokenLoader(samples, name=name, num_tokens=num_tokens, skipped=skipped, **common)  # type: ignore[arg-type]
    stream = prepare.token_stream(data_cfg, tokenizer, split, cache_dir, pad_to)
    _check_chat_documents(data_cfg, stream, tokenizer, pad_to)
    rows = packing.pack(stream.tokens, seq_len)
    needed = micro_batch_size * dp_world
    if len(rows) < needed:
        raise DataError(
            f"{stream.name} ({split} split) has {len(stream.tokens):,} tokens: {len(rows)} sample(s) of "
            f"seq_len+1={seq_len + 1}, fewer than micro_batch_size x dp_world = {needed}; "
            "lower seq_len or micro_batch_size, or add data"
        )
    mask_rows = packing.pack(stream.loss_mask, seq_len) if stream.loss_mask is not None else None
    return TokenLoader(PackedSamples(rows, mask_rows), name=stream.name, num_tokens=len(stream.tokens),
                       skipped=stream.skipped, **common)  # type: ignore[arg-type]
