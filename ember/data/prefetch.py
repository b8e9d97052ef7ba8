"""The background thread both loaders make batches in, ahead of the training loop.

One thread, not a pool: a batch is a gather of rows from memory or a streamed tokenizer call, and the
heavy parts release the GIL, so one thread keeps well ahead of a training step; more threads would
need reordering to keep the exact sample order that resuming relies on (`data.num_workers` is 0 or 1).
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable, Optional

# Prefetch threads still running. At exit they are stopped and joined before the interpreter finalizes:
# a daemon thread caught inside a torch op then is killed mid C++ frame, and the process aborts
# ("terminate called without an active exception") after an otherwise clean run.
_RUNNING: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_all() -> None:
    for thread, stop in list(_RUNNING.items()):
        stop.set()
        thread.join()


def _run(produce: Callable[[], Any], out: queue.Queue, stop: threading.Event) -> None:
    """The thread: items ahead of the consumer until stopped. It gets its queue and stop event as arguments
    (never the loader), so an old thread can neither write into a restarted loader's queue nor keep the
    loader alive. An exception is handed to the consumer, which raises it in the training thread."""
    while not stop.is_set():
        try:
            item: Any = produce()
        except BaseException as err:
            item = err
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)  # the timeout lets a stop request end a thread blocked on a full queue
                break
            except queue.Full:
                continue
        if isinstance(item, BaseException):
            return


class Prefetcher:
    """`produce()` called over and over, up to `depth` items ahead in one daemon thread (threaded=False: in
    the caller's thread, on demand). `get()` returns the items in order and raises what `produce` raised."""

    def __init__(self, produce: Callable[[], Any], *, depth: int, name: str, threaded: bool = True):
        self._produce = produce
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: Optional[threading.Thread] = None
        if threaded:
            for thread in [t for t in _RUNNING if not t.is_alive()]:
                del _RUNNING[thread]
            self._thread = threading.Thread(target=_run, args=(produce, self._queue, self._stop), name=name,
                                            daemon=True)  # never keeps the process alive after training ends
            _RUNNING[self._thread] = self._stop
            self._thread.start()

    def get(self) -> Any:
        if self._thread is None:
            return self._produce()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop and join the thread; items made ahead are dropped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            _RUNNING.pop(self._thread, None)
            self._thread = None
