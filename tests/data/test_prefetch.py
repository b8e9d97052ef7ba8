"""The one prefetch helper both loaders use: order, bounded read-ahead, errors, clean close, no leaked threads."""

from __future__ import annotations

import gc
import itertools
import threading
from typing import Callable

import numpy as np
import pytest
from data_testing import wait_until

from ember.data import prefetch
from ember.data.loader import PackedSamples, TokenLoader
from ember.data.prefetch import Prefetcher


def counter() -> tuple[list[int], Callable[[], int]]:
    made: list[int] = []
    numbers = itertools.count()

    def produce() -> int:
        made.append(next(numbers))
        return made[-1]

    return made, produce


@pytest.mark.parametrize("threaded", [True, False])
def test_items_arrive_in_order(threaded: bool):
    _, produce = counter()
    fetcher = Prefetcher(produce, depth=3, name="test-order", threaded=threaded)
    assert [fetcher.get() for _ in range(20)] == list(range(20))
    fetcher.close()


def test_read_ahead_is_bounded_and_close_stops_the_thread():
    made, produce = counter()
    fetcher = Prefetcher(produce, depth=2, name="test-bounded")
    assert fetcher.get() == 0
    # It runs ahead as far as the queue lets it: one item consumed, `depth` queued, one more made and held
    # until there is room. Then it stops making items: with the queue full, nothing can change `made`.
    wait_until(lambda: len(made) >= 1 + 2 + 1, "the thread filling the queue")
    assert len(made) == 1 + 2 + 1 and fetcher._queue.full()
    assert [fetcher.get(), fetcher.get()] == [1, 2]
    wait_until(lambda: len(made) >= 3 + 2 + 1, "the thread refilling the queue")
    assert len(made) == 3 + 2 + 1 and fetcher._queue.full()
    thread = fetcher._thread
    fetcher.close()
    assert not thread.is_alive() and thread not in prefetch._RUNNING
    fetcher.close()  # closing twice is harmless


def test_an_error_reaches_the_consumer_after_the_items_before_it():
    items = iter([0, 1])

    def produce() -> int:
        item = next(items, None)
        if item is None:
            raise OSError("disk gone")
        return item

    fetcher = Prefetcher(produce, depth=4, name="test-error")
    assert (fetcher.get(), fetcher.get()) == (0, 1)
    with pytest.raises(OSError, match="disk gone"):
        fetcher.get()
    assert fetcher._thread is None  # the failing thread is joined, not left behind


def test_a_dropped_loader_stops_its_thread():
    # The thread holds the batch function, not the loader, so dropping the loader ends the thread.
    loader = TokenLoader(PackedSamples(np.zeros((40, 9), np.uint16)), name="zeros", split="train", micro_batch_size=2)
    next(loader)
    thread = loader._prefetcher._thread
    assert thread.is_alive()
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive() and thread not in prefetch._RUNNING


def test_num_workers_zero_starts_no_thread():
    before = threading.active_count()
    loader = TokenLoader(PackedSamples(np.zeros((40, 9), np.uint16)), name="zeros", split="train",
                         micro_batch_size=2, num_workers=0)
    next(loader)
    assert loader._prefetcher._thread is None and threading.active_count() == before
