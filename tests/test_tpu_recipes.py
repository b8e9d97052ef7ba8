"""The TPU recipes: torchprime's layouts (ember/recipes/*-v6e-256.yaml) and MaxText's v5e models
(maxtext-*-v5e-256.yaml). Each loads (the schema's checks only: the XLA path's own need jax), runs on
device=tpu, and its mesh is the chips of its TPU slices; its global batch is its source's, in the largest
micro-batches `ember plan` fits on a chip, as its header and docs/tpu.md's table say (both written by
benchmarks/render_tpu_plans.py); MaxText's models are the shapes its global_parameter_scale gives."""

import math

import pytest
import torch

from ember import config as config_lib
from ember.commands.recipes import _device
from ember.models import MODELS, build_model_args
from ember.parallel.mesh_shape import resolve_mesh
from ember.plan.planner import make_plan
from ember.train import run as run_lib
from tests.helpers import load_benchmark

# recipe: (TPU type, chips per slice, slices, global batch, remat, scan_layers) as each recipe's torchprime source,
# and the micro-batches accumulated per step (torchprime runs one).
TPU_RECIPES = {
    "llama3-8b-v6e-256": ("v6e-256", 256, 1, 1024, "full", True, 1),
    "llama3.1-70b-v6e-256": ("v6e-256", 256, 1, 512, "offload", True, 1),
    "llama3.1-405b-2xv6e-256": ("v6e-256", 256, 2, 512, "offload", True, 2),
    "mixtral-8x7b-v6e-256": ("v6e-256", 256, 1, 512, "full", False, 1),
}


# MaxText's MaxText/configs/v5e/{16,32,64,128}b.sh on one v5e-256: (global_parameter_scale, per-device batch, remat,
# ici mesh), the size its README's table names, and the micro-batches accumulated per step (MaxText runs one). The
# remat is MaxText's but for the 64B's: with MaxText's full, the plan fits no micro-batch (its header says so).
MAXTEXT_RECIPES = {
    "maxtext-16b-v5e-256": (16, 6, "full", {"fsdp": 256}, 16e9, 1),
    "maxtext-32b-v5e-256": (32, 4, "full", {"fsdp": 256}, 32e9, 2),
    "maxtext-64b-v5e-256": (64, 2, "offload", {"fsdp": 256}, 64e9, 1),
    "maxtext-128b-v5e-256": (128, 1, "offload", {"fsdp": 16, "tensor": 16}, 128e9, 1),
}


def test_every_tpu_recipe_is_listed_here():
    on_tpu = {name for name in config_lib.recipe_names() if config_lib.load(name).device == "tpu"}
    assert on_tpu == set(TPU_RECIPES) | set(MAXTEXT_RECIPES)


def _maxtext_shape(scale: int) -> dict[str, int]:
    """MaxText's base.yml model (width 2048, 16 heads of 128, SwiGLU 7168, 16 layers) scaled as its
    get_individual_scales does: doublings of heads and SwiGLU, then width, then depth, in turn."""
    base_scale, rem = divmod(int(math.log2(scale)), 3)
    heads = base_scale + int(rem > 0)
    return {"dim": 2048 << (base_scale + int(rem > 1)), "n_heads": 16 << heads, "ffn_hidden_dim": 7168 << heads,
            "n_layers": 16 << base_scale}


@pytest.mark.parametrize("name", sorted(MAXTEXT_RECIPES))
def test_maxtext_recipe_is_its_scaled_model_on_a_v5e_256(name: str):
    scale, per_chip, remat, ici, size, accumulated = MAXTEXT_RECIPES[name]
    cfg = config_lib.load(name, [])
    args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
    assert {k: getattr(args, k) for k in ("dim", "n_heads", "ffn_hidden_dim", "n_layers")} == _maxtext_shape(scale)
    assert (args.head_dim, args.kv_heads, args.vocab_size, args.tie_embeddings) == (128, args.n_heads, 32000, False)
    assert (args.n_heads * args.head_dim == args.dim) == (scale in (32, 64))  # 16B's and 128B's heads are wider
    with torch.device("meta"):
        params = sum(p.numel() for p in MODELS[cfg.model.family].model_cls(args).parameters())
    assert abs(params / size - 1) < 0.03, params  # 15.8B, 31.7B, 62.8B, 125.1B
    assert (cfg.device, cfg.seq_len, cfg.model.remat, cfg.model.scan_layers) == ("tpu", 2048, remat, True)
    shape = resolve_mesh(cfg.ici_mesh, cfg.dcn_mesh, 256)
    assert {k: v for k, v in shape.ici.items() if v > 1} == ici and math.prod(shape.dcn.values()) == 1
    assert cfg.micro_batch_size * accumulated == per_chip * ici.get("tensor", 1)
    assert cfg.global_batch_size == per_chip * 256 == cfg.micro_batch_size * shape.dp * accumulated
    header = config_lib.resolve_recipe(name).read_text().split("\nseed:")[0]
    assert f"MaxText/configs/v5e/{scale}b.sh" in header and "v5e-256" in header and "device=tpu" in header


@pytest.mark.parametrize("name", sorted(TPU_RECIPES))
def test_tpu_recipe_loads_and_its_mesh_is_its_slices(name: str):
    tpu_type, chips, slices, batch, remat, scan, accumulated = TPU_RECIPES[name]
    cfg = config_lib.load(name, [])
    assert cfg.device == "tpu" and cfg.seq_len == 8192 and cfg.output_dir == f"outputs/{name}"
    assert (cfg.global_batch_size, cfg.model.remat, cfg.model.scan_layers) == (batch, remat, scan)
    shape = resolve_mesh(cfg.ici_mesh, cfg.dcn_mesh, chips * slices)
    assert shape.world_size == chips * slices
    # ICI within a slice, DCN across slices: each slice holds the whole ici mesh.
    assert math.prod(shape.ici.values()) == chips and math.prod(shape.dcn.values()) == slices
    assert cfg.micro_batch_size * shape.dp * accumulated == cfg.global_batch_size
    assert _device(cfg) == f"tpu x {chips * slices}"


def test_layouts_are_torchprimes():
    layout = {name: (cfg.ici_mesh, cfg.dcn_mesh) for name in TPU_RECIPES for cfg in [config_lib.load(name)]}
    ici, dcn = layout["llama3.1-405b-2xv6e-256"]
    assert (ici.fsdp, ici.tensor, dcn.fsdp) == (64, 4, 2)
    for name in ("llama3-8b-v6e-256", "llama3.1-70b-v6e-256", "mixtral-8x7b-v6e-256"):
        ici, dcn = layout[name]
        assert (ici.fsdp, ici.tensor, ici.expert, dcn.fsdp) == (256, 1, 1, 1), name


@pytest.mark.parametrize("name", sorted(TPU_RECIPES))
def test_header_names_its_source_and_what_it_expects(name: str):
    header = config_lib.resolve_recipe(name).read_text().split("\nseed:")[0]
    tpu_type, _, slices, *_ = TPU_RECIPES[name]
    assert "torchprime" in header and "device=tpu" in header and tpu_type in header
    assert ("two Cloud TPU" if slices == 2 else "one Cloud TPU") in header


@pytest.mark.parametrize("name, gpu_recipe", [("llama3-8b-v6e-256", "llama3-8b"),
                                              ("llama3.1-70b-v6e-256", "llama3.1-70b"),
                                              ("llama3.1-405b-2xv6e-256", "llama3.1-405b"),
                                              ("mixtral-8x7b-v6e-256", "mixtral-8x7b")])
def test_model_optimizer_and_schedule_are_the_gpu_recipes(name: str, gpu_recipe: str):
    tpu, gpu = config_lib.load(name), config_lib.load(gpu_recipe)
    assert (tpu.model.family, tpu.model.flavor, tpu.model.aux_loss_coef) == (
        gpu.model.family, gpu.model.flavor, gpu.model.aux_loss_coef)
    assert (tpu.optim, tpu.schedule, tpu.data, tpu.max_steps) == (gpu.optim, gpu.schedule, gpu.data, gpu.max_steps)


def test_gpu_recipes_show_their_device_alone():
    assert _device(config_lib.load("llama3.1-8b")) == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TPU_RECIPES) + sorted(MAXTEXT_RECIPES))
def test_recipe_fits_its_plan_at_the_largest_micro_batch_as_its_header_and_the_docs_say(name: str):
    """`ember plan RECIPE --world N --device tpu-X` (chips and TPU from the name) at the recipe's micro-batch: it fits,
    no larger one does, and the header's `# Planned:` lines and docs/tpu.md's table row are what
    benchmarks/render_tpu_plans.py writes from this plan (a planner change that moves a figure fails here; rerun it).
    The figures went stale once: the planner began extending each region of the step on its own line (a5c0787), and
    llama3-8b-v6e-256's peak went from 18.98 to 25.88 GiB while the page still said 18.98; maxtext-64b-v5e-256's
    header said 1 sequence fits where its plan fit none."""
    renderer = load_benchmark("render_tpu_plans")
    row = renderer.plan_row(name)
    cfg = config_lib.load(name)
    assert (row.fits, row.largest, row.micro_batch) == (True, cfg.micro_batch_size, cfg.micro_batch_size), row
    header = config_lib.resolve_recipe(name).read_text().split("\nseed:")[0]
    assert renderer.plan_lines(row) in header
    assert renderer.table_line(row) in renderer.PAGE.read_text()


@pytest.mark.slow
def test_maxtext_64b_keeps_its_block_inputs_on_the_host_because_full_remat_fits_no_micro_batch():
    """The recipe's one departure from MaxText (remat=offload for MaxText's full), as its header says."""
    renderer = load_benchmark("render_tpu_plans")
    world, device = renderer.chips("maxtext-64b-v5e-256")
    cfg = run_lib.load_config("maxtext-64b-v5e-256", ["model.remat=full", "micro_batch_size=1"], world_size=world)
    plan = make_plan(cfg, world, None, device)
    assert (plan.fits, plan.max_micro_batch) == (False, None)


def test_tpu_recipe_names_give_their_chips_and_device():
    renderer = load_benchmark("render_tpu_plans")
    assert set(renderer.tpu_recipes()) == set(TPU_RECIPES) | set(MAXTEXT_RECIPES)
    assert [renderer.chips(name) for name in ("llama3.1-405b-2xv6e-256", "maxtext-64b-v5e-256")] == [
        (512, "tpu-v6e"), (256, "tpu-v5e")]
    for name, (tpu_type, chips, slices, *_) in TPU_RECIPES.items():
        assert renderer.chips(name) == (chips * slices, "tpu-" + tpu_type.split("-")[0])
