"""`ember convert SRC DST [--to hf|ember|torch|peft] [--merge] [--overwrite]`: between HF safetensors, ember DCP
checkpoints and torch.save files (ember/model_io/convert.py)."""

from __future__ import annotations

import argparse

from ember.usage import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="ember convert", description="Convert a model between formats: a Hugging Face "
                       "directory (hf), an ember DCP checkpoint (ember), a torch.save file (torch). SRC and DST may "
                       "be URLs (s3://...): SRC read through a local cache, DST written locally and uploaded whole.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=("hf", "ember", "torch", "peft"), default=None,
                   help="target format (default: hf -> ember, ember -> hf, torch -> ember); peft: a LoRA run's "
                   "adapters as adapter_config.json + adapter_model.safetensors")
    p.add_argument("--merge", action="store_true", help="fold a LoRA run's (or a peft adapter's) adapters into "
                   "its base (W + alpha/r B A) and write a whole model (hf unless --to says otherwise; implied "
                   "for hf, ember, torch); refused for a whole model, which has none")
    p.add_argument("--overwrite", action="store_true", help="replace what DST holds (refused without it when "
                   "DST is not empty, and always when DST holds what the conversion reads; a file only when it "
                   "is an earlier --to torch export). --to torch writes a file, the others a directory")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from ember.model_io.convert import convert
    from ember.storage.location import check_input, check_output

    check_input(args.src, "SRC")  # a URL: its bucket, credentials and object, before any work
    check_output(args.dst, "DST")
    target = convert(args.src, args.dst, args.to, merge=args.merge, overwrite=args.overwrite)
    print(f"wrote {args.dst} ({target})")
    return 0
