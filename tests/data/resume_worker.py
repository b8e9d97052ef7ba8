"""Read batches from a loader in a fresh process, optionally from a saved state; write them and the state.

    python resume_worker.py SPEC.json OUT.pt N [STATE.pt]

SPEC holds the DataConfig fields plus seq_len, micro_batch_size, dp_rank, dp_world, vocab_size.
"""

import json
import sys

import torch

from ember.config import DataConfig, MixtureSource
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    out, n = sys.argv[2], int(sys.argv[3])
    loader_args = {k: spec.pop(k) for k in ("seq_len", "micro_batch_size", "dp_rank", "dp_world", "vocab_size")}
    spec["mixture"] = [MixtureSource(**m) for m in spec.get("mixture", [])]
    data_cfg = DataConfig(**spec)
    tokenizer = None if data_cfg.dataset == "synthetic" else build_tokenizer(data_cfg, loader_args["vocab_size"])
    loader = build_loader(data_cfg, tokenizer, **loader_args)
    if len(sys.argv) > 4:
        loader.load_state_dict(torch.load(sys.argv[4], weights_only=True))
    batches = [next(loader) for _ in range(n)]
    torch.save({"inputs": [b[0] for b in batches], "labels": [b[1] for b in batches],
                "state": loader.state_dict()}, out)
    loader.close()


if __name__ == "__main__":
    main()
