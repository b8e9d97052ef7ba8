"""Data: tokenizer, document sources, packing into samples, and the stateful rank-sharded loader.

    tok = build_tokenizer(cfg.data, vocab_size)                      # tokenizer.py
    loader = build_loader(cfg.data, tok, seq_len=..., micro_batch_size=..., dp_rank=r, dp_world=w)  # a TrainLoader
    inputs, labels = next(iter(loader))                              # (micro_batch_size, seq_len) each

`ember data prepare|tokenizer train` is ember/commands/data.py.
"""

from ember.data.loader import TokenLoader, TrainLoader, build_loader
from ember.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["TokenLoader", "Tokenizer", "TrainLoader", "build_loader", "build_tokenizer"]
