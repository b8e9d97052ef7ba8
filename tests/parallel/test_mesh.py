"""Mesh resolution and validation: the one-line errors, -1 filling, and dcn-outermost rank layout."""

import pytest
import torch

from ember import config as config_lib
from ember.config import ConfigError, MeshConfig
from ember.parallel.mesh import rank_grid
from ember.parallel.mesh_shape import MeshError, MeshShape, resolve_mesh
from ember.train import run as run_lib

SMALL = ["data.dataset=synthetic", "global_batch_size=16", "micro_batch_size=2"]


def _shape(world: int, ici: dict, dcn: dict | None = None) -> MeshShape:
    return resolve_mesh(MeshConfig(**ici), MeshConfig(**(dcn or {})), world)


def test_minus_one_takes_what_is_left():
    shape = _shape(8, {"fsdp": -1, "tensor": 2}, {"data": 2})
    assert (shape.degree("fsdp"), shape.degree("tensor"), shape.degree("data")) == (2, 2, 2)
    assert shape.dp == 4 and shape.grad_sync == 4 and shape.world_size == 8
    assert _shape(1, {"fsdp": -1}).describe() == "single device"


def test_product_must_equal_world_size():
    with pytest.raises(MeshError, match=r"fsdp=2 x tensor=2 = 4 devices, but the world size is 8"):
        _shape(8, {"fsdp": 2, "tensor": 2})
    with pytest.raises(MeshError, match=r"world size 6 is not divisible by the product of the other mesh axes \(4\), "
                                        r"so ici_mesh.fsdp=-1"):
        _shape(6, {"fsdp": -1, "tensor": 4})
    with pytest.raises(MeshError, match="only one axis may be -1, but ici_mesh.fsdp, dcn_mesh.data are"):
        _shape(4, {"fsdp": -1}, {"data": -1})
    with pytest.raises(MeshError, match=r"ici_mesh.tensor=0: a degree must be a positive integer or -1"):
        _shape(4, {"fsdp": -1, "tensor": 0})


def test_ranks_are_node_major_with_dcn_outermost():
    # Two nodes of two processes (ranks 0,1 on node 0). data across nodes, fsdp within: node 0 is data 0.
    shape = _shape(4, {"fsdp": 2}, {"data": 2})
    assert rank_grid(shape, ("data", "fsdp")).tolist() == [[0, 1], [2, 3]]
    # data within a node, fsdp across nodes: each fsdp group spans both nodes.
    shape = _shape(4, {"data": 2, "fsdp": 1}, {"fsdp": 2})
    assert rank_grid(shape, ("data", "fsdp")).tolist() == [[0, 2], [1, 3]]
    # fsdp both across (2) and within (2) nodes: coordinate = dcn * 2 + ici, so rank order.
    shape = _shape(8, {"fsdp": 2, "tensor": 2}, {"fsdp": 2})
    grid = rank_grid(shape, ("fsdp", "tensor"))
    assert grid.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(grid.flatten().tolist()) == list(range(8))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ici_mesh.fsdp=3"], "ici_mesh x dcn_mesh = fsdp=3 = 3 devices, but the world size is 4"),
        (["ici_mesh.tensor=3"], "not divisible by the product of the other mesh axes (3)"),
        (["ici_mesh.tensor=4", "ici_mesh.fsdp=1", "model.n_kv_heads=2"],
         "tensor-parallel degree 4 does not divide model.n_kv_heads=2"),
        (["ici_mesh.context=4", "ici_mesh.fsdp=1", "seq_len=12"], "needs seq_len divisible by 2 x 4 = 8"),
        (["ici_mesh.pipeline=4", "ici_mesh.fsdp=1", "model.n_layers=3"], "4 pipeline stages"),
        (["ici_mesh.pipeline=2", "parallel.pp_schedule=interleaved_1f1b"], "needs parallel.pp_stages_per_rank >= 2"),
        (["ici_mesh.pipeline=2", "parallel.pp_microbatches=3"],
         "parallel.pp_microbatches=3 must divide micro_batch_size=2"),
        (["ici_mesh.pipeline=2", "parallel.pp_microbatches=1", "parallel.pp_schedule=1f1b"],
         "1f1b needs at least as many pipeline micro-batches as stages"),
        (["ici_mesh.pipeline=2", "model.family=llama3.2"], "ties its embedding to its output projection"),
        (["ici_mesh.pipeline=2", "ici_mesh.context=2", "ici_mesh.fsdp=1"], "context and pipeline parallelism together"),
        (["ici_mesh.expert=2"], "needs a mixture-of-experts model"),
        (["ici_mesh.fsdp=4", "global_batch_size=4"], "global_batch_size=4 is not divisible by micro_batch_size x "
                                                     "data-parallel size = 2 x 4 = 8"),
        (["parallel.pp_schedule=zb"], "parallel.pp_schedule 'zb' is not one of gpipe, 1f1b, interleaved_1f1b"),
        (["model.remat=some"], "model.remat 'some' is not one of none, full, selective, op, offload"),
    ],
)
def test_parallel_config_errors_name_the_numbers(overrides, message):
    with pytest.raises(ConfigError) as err:
        run_lib.load_config("debug", SMALL + overrides, world_size=4)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_data_parallel_size_sets_gradient_accumulation():
    cfg = run_lib.load_config("debug", SMALL + ["ici_mesh.tensor=2"], world_size=8)
    shape = run_lib.mesh_shape(cfg, 8)
    assert shape.dp == 4 and config_lib.grad_accum_steps(cfg, shape.dp) == 2


def test_tensor_degree_must_divide_heads():
    with pytest.raises(ConfigError, match=r"tensor-parallel degree 8 does not divide model.n_kv_heads=4"):
        run_lib.load_config("debug", SMALL + ["ici_mesh.tensor=8", "ici_mesh.fsdp=1"], world_size=8)
    assert torch.equal(rank_grid(_shape(2, {"tensor": 2, "fsdp": 1}), ("tensor",)), torch.tensor([0, 1]))
