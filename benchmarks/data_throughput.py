"""Data pipeline speed: loader tokens/s for each source type, and the share of step time a training run
waits for data.

    python benchmarks/data_throughput.py               # every source, then a debug-recipe training run
    python benchmarks/data_throughput.py --batches 100 --train-steps 20

Sources are built in a temporary folder from the embedded corpus (so nothing is downloaded): the
embedded corpus itself, the same text as local jsonl, as prepared shards (`ember data prepare`), a 70/30
mixture, the jsonl streamed through `datasets`, and synthetic tokens. Loader figures are for the loader
alone (no model), batches of micro_batch_size x seq_len read synchronously after a warm-up batch (the
first tokenization and caching are not counted). The training run is the debug recipe with the
prefetch thread on; its `data_wait_frac` is the time `next(batch)` took over the step time (target < 2%).

Writes benchmarks/results/data_throughput-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from ember.config import DataConfig, MixtureSource
from ember.data import sources
from ember.data.loader import build_loader
from ember.data.prepare import prepare
from ember.data.tokenizer import build_tokenizer
from ember.train import run as run_lib
from ember.train.trainer import Trainer

SEQ_LEN, MICRO_BATCH, VOCAB = 256, 8, 8192


def loader_rate(data_cfg: DataConfig, tokenizer, batches: int) -> float:
    loader = build_loader(data_cfg, tokenizer, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, vocab_size=VOCAB)
    next(loader)  # warm-up: first reads, caches, the stream's first documents
    t0 = time.perf_counter()
    for _ in range(batches):
        next(loader)
    elapsed = time.perf_counter() - t0
    loader.close()
    return batches * MICRO_BATCH * SEQ_LEN / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--train-steps", type=int, default=40)
    args = parser.parse_args()

    base = DataConfig(num_workers=0)
    tokenizer = build_tokenizer(base, VOCAB)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        docs = sources.load_embedded("train", base.val_fraction)
        jsonl = tmp_path / "corpus.jsonl"
        with jsonl.open("w") as f:
            for text in docs.texts:
                f.write(json.dumps({"text": text}) + "\n")
        prepared = tmp_path / "prepared"
        prepare(replace(base, dataset=str(jsonl)), tokenizer, prepared)
        configs = {
            "embedded corpus": replace(base, dataset="embedded"),
            "local jsonl": replace(base, dataset=str(jsonl)),
            "prepared shards": replace(base, dataset=str(prepared)),
            "mixture 70/30": replace(base, mixture=[MixtureSource("embedded", 0.7), MixtureSource(str(prepared), 0.3)]),
            "jsonl streamed": replace(base, dataset=str(jsonl), streaming=True),
            "synthetic": replace(base, dataset="synthetic"),
        }
        for name, cfg in configs.items():
            rate = loader_rate(cfg, None if cfg.dataset == "synthetic" and not cfg.mixture else tokenizer, args.batches)
            rows[name] = {"loader_tokens_per_s": rate}
            print(f"{name:18s} {rate:14,.0f} tokens/s", flush=True)

        out_dir = tmp_path / "run"
        cfg = run_lib.load_config("debug", [f"max_steps={args.train_steps}", "logging_steps=10",
                                        f"output_dir={out_dir}", "metrics.console=false", "eval_batches=1"])
        Trainer(cfg).train()
        records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        waits = [r["data_wait_frac"] for r in records if "data_wait_frac" in r]
        step_tokens = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    training = {"recipe": "debug", "steps": args.train_steps, "data_wait_frac_per_window": waits,
                "data_wait_frac_median": statistics.median(waits),
                "training_tokens_per_s": statistics.median(step_tokens)}
    print(f"debug recipe training: {training['training_tokens_per_s']:,.0f} tokens/s, waiting for data "
          f"{training['data_wait_frac_median']:.2%} of step time (median of {len(waits)} logging windows)")
    out = Path(__file__).parent / "results" / "data_throughput-cpu.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "torch": torch.__version__, "seq_len": SEQ_LEN, "micro_batch_size": MICRO_BATCH,
        "loader": rows, "training": training,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
