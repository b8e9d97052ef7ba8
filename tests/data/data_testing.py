"""Shared by the data tests: the config section they build loaders from and the small corpus they build on.

(Imported by name, so it lives here rather than in conftest.py, which pytest imports its own way.)
"""

import time
from typing import Callable

from ember.config_schema import DataConfig

SMALL_VOCAB = 512
CORPUS_FILES = [
    "abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "keyword.py", "shlex.py",
    "textwrap.py", "heapq.py", "glob.py", "string.py", "json/__init__.py", "json/decoder.py",
]
LATIN1_FILE = "encoded_latin1.py"  # not UTF-8: the corpus must skip and count it (a train file)


# The real section: ember.config_schema imports nothing of ember, so the data tests need no stand-in.
DataCfg = DataConfig


def wait_until(condition: Callable[[], bool], what: str, ceiling_s: float = 60.0) -> None:
    """Poll `condition` until it holds, for what a background thread does; the ceiling only bounds a hang (on a
    loaded machine the thread is late, never wrong), so no test depends on how fast this machine is."""
    deadline = time.monotonic() + ceiling_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {ceiling_s:.0f} s"
        time.sleep(0.001)
