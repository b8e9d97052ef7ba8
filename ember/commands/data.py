"""`ember data`: `prepare` tokenizes a source once into memory-mapped shards and a manifest (ember.data.prepare),
`tokenizer train` trains a byte-level BPE tokenizer.json (ember.data.tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ember.errors import ConfigError
from ember.usage import ArgumentParser


def parser() -> ArgumentParser:
    root = ArgumentParser(prog="ember data", description="Data preparation.")
    sub = root.add_subparsers(dest="what", required=True, metavar="COMMAND")
    prep = sub.add_parser("prepare", help="tokenize SOURCE once into OUT_DIR/{train,val}.bin + manifest.json")
    prep.add_argument("source", help="embedded, a local file/folder/glob, or a hub dataset name")
    prep.add_argument("out_dir")
    prep.add_argument("--tokenizer", default=None, help="tokenizer.json / SentencePiece / tiktoken file "
                      "(default: the embedded byte-level BPE of --vocab-size)")
    prep.add_argument("--vocab-size", type=int, default=8192, help="for the default tokenizer (default 8192)")
    prep.add_argument("--text-field", default="text")
    prep.add_argument("--config", default=None, help="HF dataset config name")
    prep.add_argument("--val-fraction", type=float, default=0.02)
    prep.add_argument("--prompt-field", default=None, help="SFT data: the prompt column, masked out of the loss")
    tok = sub.add_parser("tokenizer", help="tokenizer tools")
    tok_sub = tok.add_subparsers(dest="action", required=True, metavar="COMMAND")
    train = tok_sub.add_parser("train", help="train a byte-level BPE on SOURCE's train split")
    train.add_argument("source")
    train.add_argument("out", help="a tokenizer.json path, or a folder to write tokenizer.json into")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--text-field", default="text")
    train.add_argument("--config", default=None)
    train.add_argument("--val-fraction", type=float, default=0.02)
    return root


def _data_cfg(args: argparse.Namespace) -> object:
    from ember.config import DataConfig

    return DataConfig(dataset=args.source, text_field=args.text_field, config=args.config,
                      val_fraction=args.val_fraction, tokenizer=getattr(args, "tokenizer", None),
                      prompt_field=getattr(args, "prompt_field", None))


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if args.what == "prepare":
        from ember.data.prepare import prepare
        from ember.data.tokenizer import build_tokenizer

        if args.vocab_size <= 0:
            raise ConfigError(f"--vocab-size must be positive, got {args.vocab_size}")
        data_cfg = _data_cfg(args)
        tokenizer = build_tokenizer(data_cfg, args.vocab_size if args.tokenizer is None else 2**32)
        # Started at the first report, so an error in reading the source stays a single line.
        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("documents"), TimeRemainingColumn(), console=console)
        tasks: dict[str, int] = {}

        def report(split: str, done: int, total: int) -> None:
            if not tasks:
                progress.start()
            if split not in tasks:
                tasks[split] = progress.add_task(f"tokenize {split}", total=total)
            progress.update(tasks[split], completed=done)

        try:
            manifest = prepare(data_cfg, tokenizer, Path(args.out_dir), report)
        finally:
            if tasks:
                progress.stop()
        for split, info in manifest["splits"].items():
            print(f"{split}: {info['num_documents']:,} documents, {info['num_tokens']:,} tokens -> "
                  f"{Path(args.out_dir) / info['file']}")
        print(f"train with: ember train ... data.dataset={args.out_dir}" +
              (f" data.tokenizer={args.tokenizer}" if args.tokenizer else ""))
        return 0
    from ember.data import sources
    from ember.data.tokenizer import train_bpe

    if args.vocab_size < 260:
        raise ConfigError(f"--vocab-size must be at least 260 (256 bytes + specials), got {args.vocab_size}")
    docs = sources.load_documents(_data_cfg(args), "train")
    tok = train_bpe(docs.texts, args.vocab_size)
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sources.atomic_write(out, lambda f: f.write(tok.to_str().encode()))
    print(f"trained a byte-level BPE of {tok.get_vocab_size():,} tokens on {len(docs.texts):,} documents "
          f"of {docs.name}: {out}")
    return 0
