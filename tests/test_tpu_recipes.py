"""The TPU recipes (ember/recipes/*-v6e-256.yaml): each loads (the schema's checks only: the XLA path's own need
jax), runs on device=tpu, and its mesh is the chips of its TPU slices; its global batch is torchprime's, in the
micro-batches `ember plan` fits on a chip."""

import math

import pytest

from ember import config as config_lib
from ember.commands.recipes import _device
from ember.parallel.mesh_shape import resolve_mesh

# recipe: (TPU type, chips per slice, slices, global batch, remat, scan_layers) as each recipe's torchprime source,
# and the micro-batches accumulated per step (torchprime runs one: ember's XLA step holds a micro-batch's logits).
TPU_RECIPES = {
    "llama3-8b-v6e-256": ("v6e-256", 256, 1, 1024, "full", True, 4),
    "llama3.1-70b-v6e-256": ("v6e-256", 256, 1, 512, "offload", True, 1),
    "llama3.1-405b-2xv6e-256": ("v6e-256", 256, 2, 512, "offload", True, 1),
    "mixtral-8x7b-v6e-256": ("v6e-256", 256, 1, 512, "full", False, 1),
}


def test_every_tpu_recipe_is_listed_here():
    on_tpu = {name for name in config_lib.recipe_names() if config_lib.load(name).device == "tpu"}
    assert on_tpu == set(TPU_RECIPES)


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
