"""The `ember` command.

    ember train [RECIPE] [key=value ...]     train (RECIPE: a built-in name or a YAML path; default debug)
    ember recipes                            the built-in recipes with their parameter counts

User errors (a bad key, value, path or combination) print one line on stderr and exit with 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ember.config import ConfigError

EXIT_USAGE = 2


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cmd_train(argv: list[str]) -> int:
    from ember import config as config_lib

    if argv[:1] in (["-h"], ["--help"]):
        print("usage: ember train [RECIPE] [key=value ...]\n  RECIPE: a built-in recipe (see `ember recipes`) or a YAML path; default debug")
        return 0
    recipe, overrides = "debug", list(argv)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    for item in overrides:
        if "=" not in item:
            return _fail(f"expected key=value after the recipe, got '{item}' (e.g. ember train debug max_steps=50)")
    try:
        cfg = config_lib.load(recipe, overrides)
        from ember.train import Trainer  # imported after validation so config errors come back at once

        trainer = Trainer(cfg)
    except ConfigError as err:
        return _fail(str(err))
    except (FileNotFoundError, ValueError) as err:
        # Raised while building data, tokenizer and model from user input: the message names the
        # file or key and the fix; a traceback would only bury it.
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    trainer.train()
    return 0


def cmd_recipes(argv: list[str]) -> int:
    if argv:
        return _fail(f"`ember recipes` takes no arguments, got {' '.join(argv)}")
    import torch
    from rich.console import Console
    from rich.table import Table

    from ember import config as config_lib
    from ember.models import MODELS, build_model_args

    table = Table(title="ember recipes")
    for column in ("recipe", "family", "flavor", "parameters", "seq_len", "global batch", "tokens/step"):
        table.add_column(column, justify="left" if column in ("recipe", "family", "flavor") else "right", no_wrap=True)
    for name in config_lib.recipe_names():
        cfg = config_lib.load(name)
        spec = MODELS[cfg.model.family]
        args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        with torch.device("meta"):  # shapes only: 405B costs no memory here
            n_params = sum(p.numel() for p in spec.model_cls(args).parameters())
        table.add_row(
            name,
            cfg.model.family,
            cfg.model.flavor,
            f"{n_params:,}",
            str(cfg.seq_len),
            str(cfg.global_batch_size),
            f"{cfg.seq_len * cfg.global_batch_size:,}",
        )
    console = Console()
    console.width = max(console.width, 110)  # pipes report 80 columns; never truncate the numbers
    console.print(table)
    return 0


COMMANDS = {"train": cmd_train, "recipes": cmd_recipes}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ember", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else EXIT_USAGE
    if argv[0] not in COMMANDS:
        return _fail(f"unknown command '{argv[0]}' (choose from {', '.join(sorted(COMMANDS))})")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
