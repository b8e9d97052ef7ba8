"""`ember recipes`: the built-in recipes with their parameter counts, and where the TPU ones run."""

from __future__ import annotations

import argparse
import math

from ember import config as config_lib
from ember.errors import EmberError
from ember.parallel.mesh_shape import AXES, fewest_ranks
from ember.usage import ArgumentParser

SIZE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_hidden_dim", "multiple_of",
             "ffn_dim_multiplier", "n_experts", "top_k", "moe_every")


def parser() -> ArgumentParser:
    return ArgumentParser(prog="ember recipes", description="The built-in recipes with their parameter counts "
                          "(total and active), sequence length and batch, and the device (tpu x CHIPS: a TPU "
                          "recipe's mesh, e.g. 2 x v6e-256 = 512 chips).")


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from ember.models import MODELS, build_model_args
    from ember.train import run as run_lib

    table = Table(title="ember recipes")
    left = ("recipe", "family", "flavor", "device")
    for column in ("recipe", "family", "flavor", "parameters", "active", "seq_len", "global batch", "tokens/step",
                   "device"):
        table.add_column(column, justify="left" if column in left else "right", no_wrap=True)
    for name in config_lib.recipe_names():
        cfg = config_lib.load(name)
        if cfg.device not in config_lib.XLA_DEVICES:  # a TPU recipe's checks are the XLA path's, for its chip count
            # checked on the fewest ranks its fixed axes need (an expert axis of 8: 8), the -1 axis at 1
            try:
                cfg = run_lib.load_config(name, world_size=fewest_ranks(cfg.ici_mesh, cfg.dcn_mesh))
            except EmberError as err:
                if "does not exist" not in str(err):
                    raise
                # a recipe over files its user makes first (arith-sft's data, arith-grpo's SFT model): listed
                # with what it says of itself; a model taken from model.init_from has no size until it exists
                if cfg.model.init_from:
                    table.add_row(name, cfg.model.family, f"from {cfg.model.init_from}", "-", "-", str(cfg.seq_len),
                                  str(cfg.global_batch_size), f"{cfg.seq_len * cfg.global_batch_size:,}", _device(cfg))
                    continue
        spec = MODELS[cfg.model.family]
        model_args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
        with torch.device("meta"):  # shapes only: 405B costs no memory here
            model = spec.model_cls(model_args)
            n_params = sum(p.numel() for p in model.parameters())
            # Active: what one token passes through, as the family counts it (a mixture of experts uses
            # top_k of its n_experts, in the layers that have experts); a dense family uses every parameter.
            n_active = spec.active_params(model) if spec.active_params is not None else n_params
        # a flavor whose sizes the recipe overrides (MaxText's models on a Llama 2 skeleton) is not that flavor
        resized = any(key in SIZE_KEYS for key in config_lib.model_overrides(cfg.model))
        table.add_row(
            name,
            cfg.model.family,
            f"{cfg.model.flavor}, resized" if resized else cfg.model.flavor,
            f"{n_params:,}",
            f"{n_active:,}",
            str(cfg.seq_len),
            str(cfg.global_batch_size),
            f"{cfg.seq_len * cfg.global_batch_size:,}",
            _device(cfg),
        )
    console = Console()
    console.width = max(console.width, 150)  # pipes report 80 columns; never truncate the numbers
    console.print(table)
    return 0


def _device(cfg: config_lib.JobConfig) -> str:
    """The recipe's device; with the chip count its mesh fixes ("tpu x 512"), which a TPU recipe's name spells as its
    slices ("2xv6e-256"). Recipes whose mesh fills whatever world they get (an axis of -1) show the device alone."""
    degrees = [getattr(mesh, axis) for mesh in (cfg.ici_mesh, cfg.dcn_mesh) for axis in AXES]
    return cfg.device if -1 in degrees else f"{cfg.device} x {math.prod(degrees)}"
