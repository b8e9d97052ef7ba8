"""Streaming sources (`data.streaming=true`): a Hugging Face IterableDataset, read once, never fully in memory.

Hub datasets by name, and files (jsonl/json/parquet/txt/arrow: one, a folder or a glob), local or on an object
store (s3://, gs://: read as they are consumed, never copied whole), stream through
`datasets.load_dataset(..., streaming=True)`. Each data-parallel rank reads its own part
(`split_dataset_by_node`: whole shards when they divide evenly, else every world-th example).

Order and exact resume. Documents pass through a shuffle buffer of `data.shuffle_buffer` documents;
the k-th draw of an epoch takes slot hash(seed, epoch, k) of the buffer. The state is everything the
next batch depends on: the stream's own position (the IterableDataset's state_dict), the buffer's
documents, the draw counter and the tokens carried into the next sample. (datasets' own `shuffle`
loses its buffer on resume, which is why the buffer is ember's.) A snapshot is taken after every batch
and travels with it, so the state reports what the trainer consumed, not what the prefetch thread made.
At the end of the stream the next epoch starts (`set_epoch`), with new draws.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ember.config_schema import DataConfig
from ember.data import sources
from ember.data.hub import import_datasets
from ember.data.prefetch import Prefetcher
from ember.data.tokenizer import AnyTokenizer
from ember.errors import ConfigError, DataError, first_error_line
from ember.storage.cache import remote_files
from ember.storage.location import is_url

if TYPE_CHECKING:
    import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}


def _draw(seed: int, epoch: int, k: int, n: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def open_stream(data_cfg: DataConfig, split: str, dp_rank: int,
                dp_world: int) -> tuple[datasets.IterableDataset, str]:
    """The rank's IterableDataset for ember's `split` ("train" -> data.split, "val" -> data.val_split)."""
    datasets = import_datasets("data.streaming=true")
    from datasets.distributed import split_dataset_by_node

    hf_split = data_cfg.split if split == "train" else data_cfg.val_split
    spec = data_cfg.dataset
    if is_url(spec):  # objects on a store, read as they are consumed (never copied whole)
        files = remote_files(spec, tuple(BUILDERS))
    else:
        files = sources.local_files(spec, suffixes=tuple(BUILDERS))
    if files is not None and split == "val":
        if data_cfg.val_split is not None:
            raise ConfigError(f"data.val_split={data_cfg.val_split} names a split of a hub dataset; streamed files "
                              "have none: drop it (the run then has no validation), or set data.streaming=false to "
                              "hold out data.val_fraction of the documents")
        raise DataError("streamed files have no held-out split (data.streaming=false holds out data.val_fraction)")
    if hf_split is None:
        raise DataError("a streamed source has no held-out split unless data.val_split names one (e.g. validation)")
    try:
        if files is not None:
            kinds = {BUILDERS[os.path.splitext(str(f))[1]] for f in files}
            if len(kinds) > 1:
                raise DataError(f"data.dataset '{spec}' mixes file types ({', '.join(sorted(kinds))}); "
                                 "stream one kind, or use data.mixture")
            builder = kinds.pop()
            extra = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                       **extra)
            name = spec
        else:
            ds = datasets.load_dataset(spec, data_cfg.config, split=hf_split, streaming=True)
            name = f"{spec} ({hf_split}, streamed)"
    except ValueError:
        raise
    except Exception as err:  # network, auth, unknown name or config: all user-fixable, all one line
        raise DataError(f"cannot stream data.dataset '{spec}': {first_error_line(err)}") from None
    if dp_world > 1:
        ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world)
    return ds, name


class StreamReader:
    """Turns a document stream into (micro_batch_size, seq_len + 1) token rows; its state is exact."""

    def __init__(self, dataset: datasets.IterableDataset, tokenizer: AnyTokenizer, text_field: str, seq_len: int,
                 micro_batch_size: int, seed: int, buffer_size: int, name: str):
        self.dataset, self.tokenizer, self.text_field = dataset, tokenizer, text_field
        self.row, self.mb, self.seed, self.name = seq_len + 1, micro_batch_size, seed, name
        self.buffer_size = max(buffer_size, 1)
        self.epoch, self.draws = 0, 0
        self.buffer: list[str] = []
        self.carry: list[int] = []
        self.skipped = 0  # documents without usable text (empty, missing field, not a string)
        self._iter: Optional[Any] = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "draws": self.draws, "buffer": list(self.buffer), "carry": list(self.carry),
                "skipped": self.skipped, "stream": copy.deepcopy(self.dataset.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.draws, self.skipped = int(state["epoch"]), int(state["draws"]), int(state["skipped"])
        self.buffer, self.carry = list(state["buffer"]), [int(t) for t in state["carry"]]
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(state["stream"])
        self._iter = None

    def _text(self, row: Any) -> Optional[str]:
        text = row.get(self.text_field) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            if isinstance(row, dict) and self.text_field not in row and not self.carry and not self.buffer:
                raise DataError(f"{self.name} has no '{self.text_field}' field (it has: {', '.join(row)}); "
                                 "set data.text_field to the text column")
            self.skipped += 1
            return None
        return text

    def _fill(self) -> bool:
        """Top the buffer up from the stream; False when the stream has ended (this epoch)."""
        if self._iter is None:
            self._iter = iter(self.dataset)
        while len(self.buffer) < self.buffer_size:
            try:
                row = next(self._iter)
            except StopIteration:
                return False
            text = self._text(row)
            if text is not None:
                self.buffer.append(text)
        return True

    def _next_document(self) -> str:
        for _ in range(2):
            more = self._fill()
            if self.buffer:
                slot = _draw(self.seed, self.epoch, self.draws, len(self.buffer))
                self.draws += 1
                text = self.buffer[slot]
                self.buffer[slot] = self.buffer[-1]
                self.buffer.pop()
                return text
            if not more:  # stream and buffer both empty: the next epoch
                self.epoch, self.draws = self.epoch + 1, 0
                self.dataset.set_epoch(self.epoch)
                self._iter = None
        raise DataError(f"{self.name} yields no documents with text in '{self.text_field}'; check data.dataset")

    def next_rows(self) -> torch.Tensor:
        need = self.mb * self.row
        while len(self.carry) < need:
            self.carry += self.tokenizer.encode(self._next_document()) + [self.tokenizer.eos_id]
        rows, self.carry = self.carry[:need], self.carry[need:]
        return torch.tensor(rows, dtype=torch.int64).view(self.mb, self.row)  # (mb, seq_len + 1)


class StreamLoader:
    """The streaming counterpart of TokenLoader: (inputs, labels) forever, a prefetch thread, exact state."""

    num_samples = None
    num_tokens = None

    def __init__(self, make_reader: Callable[[], StreamReader], *, split: str, prefetch: int = 4, num_workers: int = 1):
        self._make_reader = make_reader
        self.reader = make_reader()
        self.name, self.split = self.reader.name, split
        self.num_workers, self.prefetch = num_workers, max(prefetch, 1)
        self._state = self.reader.state_dict()  # after the last consumed batch
        self._initial = copy.deepcopy(self._state)
        self._prefetcher: Optional[Prefetcher] = None

    def __iter__(self) -> "StreamLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefetcher is None:
            reader = self.reader
            reader.load_state_dict(self._state)  # made ahead from the consumed position
            self._prefetcher = Prefetcher(lambda: (reader.next_rows(), reader.state_dict()), depth=self.prefetch,
                                          name=f"ember-stream-{self.split}", threaded=self.num_workers > 0)
        try:
            rows, state = self._prefetcher.get()
        except BaseException:
            self._shutdown()
            raise
        self._state = state
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _shutdown(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        self._shutdown()

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._shutdown()
        self._state = copy.deepcopy(state)
        self.reader.load_state_dict(self._state)

    def reset(self) -> None:
        self.load_state_dict(self._initial)

    def mixture_counts(self) -> None:
        return None

    def describe(self) -> str:
        return f"{self.name} ({self.split}): streamed, shuffle buffer {self.reader.buffer_size} documents"


def build_stream_loader(data_cfg: DataConfig, tokenizer: Optional[AnyTokenizer], *, split: str, seq_len: int,
                        micro_batch_size: int, dp_rank: int, dp_world: int, seed: int) -> StreamLoader:
    if tokenizer is None:
        raise DataError("data.streaming=true needs a tokenizer")
    # Opened once here so that a bad name, path or split fails at start, not in the prefetch thread.
    dataset, name = open_stream(data_cfg, split, dp_rank, dp_world)

    def make_reader() -> StreamReader:
        return StreamReader(dataset, tokenizer, data_cfg.text_field, seq_len, micro_batch_size,
                            seed + dp_rank, data_cfg.shuffle_buffer if split == "train" else 1, name)

    loader = StreamLoader(make_reader, split=split, prefetch=data_cfg.prefetch, num_workers=data_cfg.num_workers)
    loader.reader._fill()  # reads the first documents now: a missing text field is refused at start
    loader.reader.load_state_dict(loader._initial)
    return loader
