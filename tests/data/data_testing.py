"""Shared by the data tests: the config stand-in and the small corpus they build on.

(Imported by name, so it lives here rather than in conftest.py, which pytest imports its own way.)
"""

from dataclasses import dataclass, field
from typing import Any, Optional

SMALL_VOCAB = 512
CORPUS_FILES = [
    "abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "keyword.py", "shlex.py",
    "textwrap.py", "heapq.py", "glob.py", "string.py", "json/__init__.py", "json/decoder.py",
]
LATIN1_FILE = "encoded_latin1.py"  # not UTF-8: the corpus must skip and count it (a train file)


@dataclass
class DataCfg:
    """The fields of ember.config.DataConfig: the data package needs only these attributes."""

    dataset: str = "embedded"
    tokenizer: Optional[str] = None
    text_field: str = "text"
    config: Optional[str] = None
    split: str = "train"
    val_fraction: float = 0.02
    num_workers: int = 1
    prefetch: int = 4
    mixture: list[Any] = field(default_factory=list)
    streaming: bool = False
    shuffle_buffer: int = 1000
    val_split: Optional[str] = None
    document_mask: bool = False
    prompt_field: Optional[str] = None
    messages_field: Optional[str] = None
    chat_template: str = "auto"
    packing: bool = True
