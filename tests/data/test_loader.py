"""The loader: shapes, determinism, rank sharding, epochs, exact resume, rank-count changes, synthetic data."""

from pathlib import Path

import numpy as np
import pytest
import torch
from data_testing import DataCfg, wait_until

from ember.data.loader import PackedSamples, TokenLoader, build_loader
from ember.data.tokenizer import Tokenizer

SEQ = 7  # samples of 8 tokens


def index_loader(num_samples: int = 40, mb: int = 2, rank: int = 0, world: int = 1, seed: int = 0,
                 workers: int = 1) -> TokenLoader:
    """A loader whose sample i holds tokens i*8 .. i*8+7, so a batch names the samples it took."""
    rows = np.arange(num_samples * (SEQ + 1), dtype=np.uint32).reshape(num_samples, SEQ + 1)
    return TokenLoader(
        PackedSamples(rows), name="index", split="train", micro_batch_size=mb,
        dp_rank=rank, dp_world=world, seed=seed, num_workers=workers, prefetch=3,
    )


def ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return (batch[0][:, 0] // (SEQ + 1)).tolist()


def take(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_shapes_and_shift(small_tokenizer: Tokenizer):
    loader = build_loader(DataCfg(), small_tokenizer, seq_len=32, micro_batch_size=4)
    inputs, labels = next(loader)
    assert inputs.shape == labels.shape == (4, 32) and inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert int(inputs.max()) < small_tokenizer.vocab_size
    assert loader.num_samples == loader.num_tokens // 33 and "samples of 32+1" in loader.describe()
    assert "1 file(s) skipped as not UTF-8" in loader.describe()
    # The 11 readable documents are separated by EOS (the last one may fall in the dropped tail).
    assert int((loader.samples.rows == small_tokenizer.eos_id).sum()) in (10, 11)
    loader.close()


def test_same_seed_same_batches(small_tokenizer: Tokenizer):
    def make(seed: int) -> TokenLoader:
        return build_loader(DataCfg(), small_tokenizer, seq_len=16, micro_batch_size=4, seed=seed)

    a, b, c = make(0), make(0), make(1)
    first = take(a, 5)
    assert same(first, take(b, 5))
    assert not same(first, take(c, 5))


def test_val_split_differs_from_train(small_tokenizer: Tokenizer):
    train = build_loader(DataCfg(), small_tokenizer, seq_len=16, micro_batch_size=2)
    val = build_loader(DataCfg(), small_tokenizer, seq_len=16, micro_batch_size=2, split="val")
    assert val.num_tokens < train.num_tokens
    train_rows = {tuple(r) for r in train.samples.rows.tolist()}
    assert not any(tuple(r) in train_rows for r in val.samples.rows.tolist())
    val.reset()
    assert same(take(val, 3),
                take(build_loader(DataCfg(), small_tokenizer, seq_len=16, micro_batch_size=2, split="val"), 3))


def test_ranks_read_disjoint_samples_and_epochs_cover_all():
    num_samples, mb, world = 41, 3, 2  # 6 batches of 6 samples per epoch, a tail of 5 dropped
    ranks = [index_loader(num_samples, mb, rank=r, world=world) for r in range(world)]
    epoch0 = [ids(next(loader)) for _ in range(6) for loader in ranks]
    flat = [i for batch in epoch0 for i in batch]
    assert len(flat) == len(set(flat)) == 36
    assert [loader.state_dict() for loader in ranks] == [{"epoch": 0, "cursor": 36}] * 2
    epoch1 = [i for _ in range(6) for loader in ranks for i in ids(next(loader))]
    assert ranks[0].state_dict() == {"epoch": 1, "cursor": 36}
    assert len(set(epoch1)) == 36 and epoch1 != flat  # a new permutation


def test_resume_gives_the_uninterrupted_batches():
    # 40 samples / (2 x 1) per batch = 20 batches an epoch: k=17 resumes across the epoch boundary.
    for k in (0, 1, 5, 17, 20):
        full = take(index_loader(workers=1), k + 6)
        first = index_loader(workers=1)
        take(first, k)
        # The thread runs ahead until its queue is full: the state must still say "k consumed".
        wait_until(lambda: first._prefetcher is None or first._prefetcher._queue.full(), "the loader's read-ahead")
        state = first.state_dict()
        resumed = index_loader(workers=1)
        resumed.load_state_dict(state)
        assert same(take(resumed, 6), full[k:]), k
        # Loading into a loader that already prefetched elsewhere discards those batches.
        first.load_state_dict(state)
        assert same(take(first, 6), full[k:]), k


def test_prefetch_thread_matches_synchronous_loading():
    assert same(take(index_loader(workers=1), 25), take(index_loader(workers=0), 25))


def test_rank_count_change_continues_the_global_order():
    one = index_loader(mb=2, world=1)
    single = [ids(b) for b in take(one, 8)]
    two = [index_loader(mb=2, rank=r, world=2) for r in range(2)]
    for k in range(4):
        union = ids(next(two[0])) + ids(next(two[1]))
        assert union == single[2 * k] + single[2 * k + 1]
    # Resume a 1-rank state on 2 ranks: they read what the single rank would have read next.
    state = one.state_dict()
    after = [ids(b) for b in take(one, 2)]
    for rank, loader in enumerate(index_loader(mb=2, rank=r, world=2) for r in range(2)):
        loader.load_state_dict(state)
        assert ids(next(loader)) == after[rank]


def test_worker_errors_reach_the_training_thread():
    class Broken(PackedSamples):
        def get(self, indices):
            raise OSError("disk gone")

    loader = TokenLoader(Broken(np.zeros((10, 8), np.uint16)), name="broken", split="train", micro_batch_size=2)
    with pytest.raises(OSError, match="disk gone"):
        next(loader)
    assert loader.state_dict() == {"epoch": 0, "cursor": 0}


def test_synthetic_is_deterministic_and_needs_no_tokenizer():
    cfg = DataCfg(dataset="synthetic")
    def make(**kw) -> TokenLoader:
        return build_loader(cfg, None, seq_len=16, micro_batch_size=4, vocab_size=100, **kw)

    a = take(make(), 4)
    assert same(a, take(make(), 4))
    assert not same(a, take(make(seed=1), 4))
    assert not same(a, take(make(split="val"), 4))
    assert all(int(x.min()) >= 0 and int(x.max()) < 100 for x, _ in a)
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])
    rank0, rank1 = make(dp_rank=0, dp_world=2), make(dp_rank=1, dp_world=2)
    assert torch.equal(torch.cat([next(rank0)[0], next(rank1)[0]]), torch.cat([a[0][0], a[1][0]]))
    resumed = make()
    resumed.load_state_dict({"epoch": 0, "cursor": 8})
    assert same(take(resumed, 2), a[2:])
    with pytest.raises(ValueError, match=r"needs a vocab_size"):
        build_loader(cfg, None, seq_len=16, micro_batch_size=4)


def test_every_loader_the_trainer_gets_is_a_train_loader():
    from ember.data.loader import TrainLoader
    from ember.data.stream import StreamLoader

    # TrainLoader holds the methods the trainer calls: a loader kind that lacks one fails here, not mid-run.
    assert issubclass(TokenLoader, TrainLoader) and issubclass(StreamLoader, TrainLoader)
    loader = build_loader(DataCfg(dataset="synthetic"), None, seq_len=16, micro_batch_size=4, vocab_size=100)
    assert isinstance(loader, TrainLoader) and loader.mixture_counts() is None


def test_the_real_config_section_fits():
    from dataclasses import fields

    from ember.config import DataConfig

    assert [f.name for f in fields(DataConfig)] == [f.name for f in fields(DataCfg)]  # the stand-in has not drifted
    loader = build_loader(DataConfig(dataset="synthetic", num_workers=0), None, seq_len=8, micro_batch_size=2,
                          vocab_size=50)
    assert next(loader)[0].shape == (2, 8)


def test_too_little_data(tmp_path: Path, small_tokenizer: Tokenizer):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words")
    cfg = DataCfg(dataset=str(path))
    with pytest.raises(ValueError, match=r"tiny\.txt \(train split\) has \d+ tokens: "
                                         r"0 sample\(s\) of seq_len\+1=257.*lower seq_len"):
        build_loader(cfg, small_tokenizer, seq_len=256, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"needs a tokenizer"):
        build_loader(cfg, None, seq_len=4, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"model\.vocab_size=100"):
        build_loader(cfg, small_tokenizer, seq_len=4, micro_batch_size=1, vocab_size=100)
