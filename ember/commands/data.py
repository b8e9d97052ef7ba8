"""`ember data`: `prepare` tokenizes a source once into memory-mapped shards and a manifest (ember.data.prepare),
`tokenizer train` trains a byte-level BPE tokenizer.json (ember.data.tokenizer), `gym` writes rows of one of
reasoning-gym's procedural generators (ember.finetune.grpo_data) as a jsonl that SFT, GRPO and the generative eval
read. None writes over an existing output without --overwrite: it may be what a run trains on."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ember.errors import ConfigError, EmberError, first_error_line
from ember.usage import ArgumentParser

# The shared data code names the `data.*` keys `ember train` takes; here the user typed these arguments.
_ARGUMENTS = {"dataset": "SOURCE", "text_field": "--text-field", "val_fraction": "--val-fraction",
              "config": "--config", "tokenizer": "--tokenizer", "prompt_field": "--prompt-field"}
# The first bytes of a tokenizer.json as the `tokenizers` library writes it (its keys in a fixed order).
_TOKENIZER_JSON_HEAD = re.compile(rb'\A\s*\{\s*"version"\s*:\s*"[^"]*"\s*,\s*"truncation"\s*:')


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
    prep.add_argument("--overwrite", action="store_true", help="replace what a non-empty OUT_DIR holds")
    tok = sub.add_parser("tokenizer", help="tokenizer tools")
    tok_sub = tok.add_subparsers(dest="action", required=True, metavar="COMMAND")
    train = tok_sub.add_parser("train", help="train a byte-level BPE on SOURCE's train split")
    train.add_argument("source")
    train.add_argument("out", help="a tokenizer.json path, or a folder to write tokenizer.json into")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--text-field", default="text")
    train.add_argument("--config", default=None)
    train.add_argument("--val-fraction", type=float, default=0.02)
    train.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    gym = sub.add_parser("gym", help="write N rows of a reasoning-gym generator as {prompt, response, answer} jsonl")
    gym.add_argument("name", help="the generator, e.g. basic_arithmetic (the .[rl] extra)")
    gym.add_argument("out", help="the .jsonl to write")
    gym.add_argument("--size", type=int, default=1000, help="rows (default 1000)")
    gym.add_argument("--seed", type=int, default=0)
    gym.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="a generator option (a YAML value: max_digits=2, operators=[+,-]); repeatable")
    gym.add_argument("--response", action="append", default=[], metavar="TEMPLATE",
                     help="the response SFT trains, with {answer} in it (default ' {answer}'); given several "
                     "times, each row takes one at random (seeded)")
    gym.add_argument("--exclude", action="append", default=[], metavar="FILE",
                     help="leave out rows whose prompt is in FILE (a held-out set); repeatable")
    gym.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return root


def _data_cfg(args: argparse.Namespace) -> object:
    from ember.config import DataConfig

    return DataConfig(dataset=args.source, text_field=args.text_field, config=args.config,
                      val_fraction=args.val_fraction, tokenizer=getattr(args, "tokenizer", None),
                      prompt_field=getattr(args, "prompt_field", None))


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from ember.data import sources

    if args.what == "gym":
        return _gym(args)
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    try:
        sources.check_source_exists(args.source, "SOURCE")
        return _prepare(args) if args.what == "prepare" else _train_tokenizer(args)
    except EmberError as err:
        raise type(err)(_in_command_words(first_error_line(err))) from None


def _in_command_words(message: str) -> str:
    """MESSAGE with each `data.KEY` (`data.KEY=VALUE`) this command takes as an argument named as that argument."""
    def name(match: re.Match) -> str:
        argument = _ARGUMENTS.get(match[1])
        return match[0] if argument is None else argument + (" " if match[2] else "")

    return re.sub(r"\bdata\.(\w+)(=)?", name, message).replace("unset --", "leave out --")


def _prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ember.data.prepare import check_out_dir, prepare
    from ember.data.tokenizer import build_tokenizer

    if args.vocab_size <= 0:
        raise ConfigError(f"--vocab-size must be positive, got {args.vocab_size}")
    data_cfg = _data_cfg(args)
    out_dir = Path(args.out_dir)
    check_out_dir(data_cfg, out_dir, args.overwrite)  # before the default tokenizer is trained
    tokenizer = build_tokenizer(data_cfg, args.vocab_size if args.tokenizer is None else 2**32)
    # Started at the first report, so an error in reading the source stays a single line.
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("documents"), TimeRemainingColumn(), console=Console(stderr=True))
    tasks: dict[str, int] = {}

    def report(split: str, done: int, total: int) -> None:
        if not tasks:
            progress.start()
        if split not in tasks:
            tasks[split] = progress.add_task(f"tokenize {split}", total=total)
        progress.update(tasks[split], completed=done)

    try:
        manifest = prepare(data_cfg, tokenizer, out_dir, report, overwrite=args.overwrite)
    finally:
        if tasks:
            progress.stop()
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_documents']:,} documents, {info['num_tokens']:,} tokens -> "
              f"{out_dir / info['file']}")
    if "val" not in manifest["splits"]:
        print("val: none (--val-fraction 0): a run on these shards trains without validation")
    # The default tokenizer is the embedded BPE of this vocab size and val_fraction: the run must build the same.
    same_tokenizer = (f" data.tokenizer={args.tokenizer}" if args.tokenizer else
                      f" model.vocab_size={args.vocab_size} data.val_fraction={args.val_fraction}")
    print(f"train with: ember train ... data.dataset={args.out_dir}{same_tokenizer}")
    return 0


def _train_tokenizer(args: argparse.Namespace) -> int:
    from ember.data import sources
    from ember.data.tokenizer import fewer_tokens_note, train_bpe

    if args.vocab_size < 260:
        raise ConfigError(f"--vocab-size must be at least 260 (256 bytes + specials), got {args.vocab_size}")
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out = out / "tokenizer.json"
    _check_tokenizer_out(out, args.overwrite)
    docs = sources.load_documents(_data_cfg(args), "train")
    tok = train_bpe(docs.texts, args.vocab_size)
    sources.atomic_write(out, lambda f: f.write(tok.to_str().encode()))  # written beside, renamed into place
    print(f"trained a byte-level BPE of {tok.get_vocab_size():,} tokens on {len(docs.texts):,} documents "
          f"of {docs.name}: {out}")
    short = fewer_tokens_note(tok.get_vocab_size(), args.vocab_size, f"--vocab-size {args.vocab_size:,}")
    if short:
        print(f"note: {short}")
    return 0


def _gym(args: argparse.Namespace) -> int:
    """`ember data gym`: the generator's rows as {prompt, response, answer} (the response, what SFT trains, is a
    --response template filled with the answer), without the prompts of the --exclude files, written whole or not
    at all."""
    import json
    import random

    import yaml

    from ember.data import sources
    from ember.data.jsonl import read_json_rows
    from ember.finetune.grpo_data import GYM_PREFIX, read_prompt_rows

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"'{out}' exists; give --overwrite to replace it, or write to another OUT")
    if args.size < 1:
        raise ConfigError(f"--size must be >= 1, got {args.size}")
    options = {}
    for item in args.option:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ConfigError(f"--option {item!r}: give KEY=VALUE, e.g. --option max_digits=2")
        options[key] = yaml.safe_load(value)
    for path in args.exclude:
        if not Path(path).is_file():
            raise ConfigError(f"--exclude {path}: no such file; give a jsonl of rows with a prompt (a held-out set)")
    if out.is_dir():
        raise ConfigError(f"'{out}' is a directory; give the .jsonl file to write")
    if out.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"'{out}': write a .jsonl (what SFT, task=grpo and ember eval gen= read)")
    excluded = {row.get("prompt") for path in args.exclude for _, row in read_json_rows(Path(path), "--exclude")}
    rows = [row for _, row in read_prompt_rows(GYM_PREFIX + args.name, gym_size=args.size, seed=args.seed,
                                               gym_options=options) if row["prompt"] not in excluded]
    if not rows:
        raise ConfigError(f"every row of {args.name} is in the --exclude files; raise --size or change --option")
    templates = args.response or [" {answer}"]
    if any("{answer}" not in t for t in templates):
        raise ConfigError(f"--response {next(t for t in templates if '{answer}' not in t)!r} has no {{answer}}; "
                          "write where the answer goes, e.g. --response ' The answer is {answer}.'")
    pick = random.Random(args.seed)
    text = "".join(json.dumps({**row, "response": pick.choice(templates).replace("{answer}", str(row["answer"]))})
                   + "\n" for row in rows)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sources.atomic_write(out, lambda f: f.write(text.encode()))
    except OSError as err:
        raise ConfigError(f"cannot write '{out}' ({err.strerror or err}); write to another OUT") from None
    distinct = len({row["prompt"] for row in rows})
    print(f"{len(rows):,} rows ({distinct:,} distinct prompts) of reasoning-gym {args.name} -> {out}"
          + (f"; {args.size - len(rows):,} left out as in --exclude" if len(rows) < args.size else ""))
    return 0


def _check_tokenizer_out(out: Path, overwrite: bool) -> None:
    """A new path, or (with --overwrite) a tokenizer.json: never a directory or another kind of file (a user's
    data), and never a tokenizer a run may use without being asked."""
    if out.is_dir():
        raise ConfigError(f"'{out}' is a directory; give a tokenizer.json path or a folder to write one into")
    if not out.exists():
        return
    with out.open("rb") as f:
        is_tokenizer = bool(_TOKENIZER_JSON_HEAD.match(f.read(256)))
    if not is_tokenizer:
        raise ConfigError(f"'{out}' exists and is not a tokenizer.json; write to another OUT (a new .json path or "
                          "a folder)")
    if not overwrite:
        raise ConfigError(f"'{out}' exists; give --overwrite to replace it, or write to another OUT")
