"""`ember recipes`: the built-in recipes with their parameter counts."""

from __future__ import annotations

import argparse

from ember.usage import ArgumentParser


def parser() -> ArgumentParser:
    return ArgumentParser(prog="ember recipes", description="The built-in recipes with their parameter counts "
                          "(total and active), sequence length and batch.")


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from ember import config as config_lib

    from ember import run as run_lib
    from ember.models import MODELS, build_model_args

    table = Table(title="ember recipes")
    for column in ("recipe", "family", "flavor", "parameters", "active", "seq_len", "global batch", "tokens/step"):
        table.add_column(column, justify="left" if column in ("recipe", "family", "flavor") else "right", no_wrap=True)
    for name in config_lib.recipe_names():
        cfg = run_lib.load_config(name)
        spec = MODELS[cfg.model.family]
        model_args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        with torch.device("meta"):  # shapes only: 405B costs no memory here
            model = spec.model_cls(model_args)
            n_params = sum(p.numel() for p in model.parameters())
            # Active: what one token passes through, as the family counts it (a mixture of experts uses
            # top_k of its n_experts, in the layers that have experts); a dense family uses every parameter.
            n_active = spec.active_params(model) if spec.active_params is not None else n_params
        table.add_row(
            name,
            cfg.model.family,
            cfg.model.flavor,
            f"{n_params:,}",
            f"{n_active:,}",
            str(cfg.seq_len),
            str(cfg.global_batch_size),
            f"{cfg.seq_len * cfg.global_batch_size:,}",
        )
    console = Console()
    console.width = max(console.width, 130)  # pipes report 80 columns; never truncate the numbers
    console.print(table)
    return 0
