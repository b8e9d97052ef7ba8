"""Shared by the data tests: the config section they build loaders from and the small corpus they build on.

(Imported by name, so it lives here rather than in conftest.py, which pytest imports its own way.)
"""

from ember.config_schema import DataConfig

SMALL_VOCAB = 512
CORPUS_FILES = [
    "abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "keyword.py", "shlex.py",
    "textwrap.py", "heapq.py", "glob.py", "string.py", "json/__init__.py", "json/decoder.py",
]
LATIN1_FILE = "encoded_latin1.py"  # not UTF-8: the corpus must skip and count it (a train file)


# The real section: ember.config_schema imports nothing of ember, so the data tests need no stand-in.
DataCfg = DataConfig
