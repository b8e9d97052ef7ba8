"""ember.xla.program_cost: a compiled program's matmuls and bytes, its loops' bodies counted as often as they run;
ember.xla.plan.priced_step: the step time from them, on a CPU by measured rates and on an accelerator by its
datasheet's."""

import math

import pytest
import torch

from ember.plan import cost as cost_lib
from ember.xla import cpu_rates as xla_rates
from ember.xla.plan import priced_step
from ember.xla.program_cost import Dot, ProgramCost, program_cost

LAYERS, ROWS, DIM = 6, 32, 48


def _scanned_grad_hlo() -> tuple[str, float]:
    """The optimized HLO of the gradient of a 6-layer scan of tanh(x @ w), and XLA's own FLOP count of it."""
    import jax
    import jax.numpy as jnp

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        jnp.ones((ROWS, DIM)), jnp.ones((LAYERS, DIM, DIM))).compile()
    analysis = compiled.cost_analysis()
    return compiled.as_text(), (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


def test_a_scanned_bodys_matmuls_count_once_per_layer():
    text, xla_flops = _scanned_grad_hlo()
    cost = program_cost(text)
    # per layer: the forward product, and the backward's two (the input's gradient and the weight's)
    assert cost.dot_flops == LAYERS * 3 * 2 * ROWS * DIM * DIM
    assert sum(cost.dots.values()) == 3 * LAYERS
    # XLA's own analysis counts each loop body once: what this module exists to correct
    assert xla_flops < cost.dot_flops / 2


WHILE_HLO = """HloModule m, entry_computation_layout={(f32[4,1024]{1,0})->f32[4,1024]{1,0}}

%slice_fusion (param_0: f32[4,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[4,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={1,1024}
}

%update_fusion (param_0.1: f32[4,1024], param_1.1: f32[1,1024], param_2: s32[]) -> f32[4,1024] {
  %param_0.1 = f32[4,1024]{1,0} parameter(0)
  %param_1.1 = f32[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  ROOT %dus = f32[4,1024]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %c.1)
}

%body (arg: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %arg = (s32[], f32[4,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buffer = f32[4,1024]{1,0} get-tuple-element(%arg), index=1
  %row = f32[1,1024]{1,0} fusion(%buffer, %i), kind=kLoop, calls=%slice_fusion
  %doubled = f32[1,1024]{1,0} add(%row, %row)
  %written = f32[4,1024]{1,0} fusion(%buffer, %doubled, %i), kind=kLoop, calls=%update_fusion
  ROOT %out = (s32[], f32[4,1024]{1,0}) tuple(%i, %written)
}

%cond (arg.1: (s32[], f32[4,1024])) -> pred[] {
  %arg.1 = (s32[], f32[4,1024]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4,1024]) -> f32[4,1024] {
  %x = f32[4,1024]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,1024]{1,0}) tuple(%zero, %x)
  %w = (s32[], f32[4,1024]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %result = f32[4,1024]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_loop_slices_and_updates_in_place_move_only_their_rows():
    cost = program_cost(WHILE_HLO)
    row = 1024 * 4
    # per trip: the slice reads a row and writes one (plus its s32 index), the add reads two rows and writes one,
    # the update reads the new row (and its index) and writes it in place; the whole buffer never moves
    assert cost.op_bytes == {2 * row + 4: 8, 3 * row: 4} and not cost.dots
    assert cost.memory_bytes == 4 * ((2 * row + 4) * 2 + 3 * row)


def test_a_loop_without_a_known_trip_count_is_refused_by_name():
    with pytest.raises(ValueError, match="while loop w has no known trip count"):
        program_cost(WHILE_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""))


def _dot(dtype: str = "bf16") -> Dot:
    return Dot((4096, 2048), (2048, 8192), dtype, dtype, "f32", (), (), (1,), (0,))


def test_an_accelerators_step_is_its_datasheets_rates_over_the_programs_work():
    cost = ProgramCost()
    cost.dots[_dot()] = 10
    cost.op_bytes[3 * 2**20] = 100
    cost.collective_bytes = 2**30
    fab = cost_lib.fabric("tpu-v6e")
    step = priced_step(cost, 8, "tpu-v6e", torch.bfloat16)
    assert step["matmul_flops"] == 10 * 2 * 4096 * 2048 * 8192
    assert step["matmul_s"] == pytest.approx(step["matmul_flops"] / (918e12 * cost_lib.COMPUTE_EFFICIENCY))
    assert step["memory_s"] == pytest.approx(300 * 2**20 / 1640e9)
    assert step["collective_s"] == pytest.approx(2**30 / (fab.intra_gbs * 1e9 * cost_lib.LINK_EFFICIENCY))
    assert step["step_s"] == pytest.approx(step["matmul_s"] + step["memory_s"] + step["collective_s"])


def test_a_cpu_step_is_every_virtual_devices_work_at_the_measured_rates(monkeypatch: pytest.MonkeyPatch):
    cost = ProgramCost()
    cost.dots[_dot("f32")] = 3
    small, large = 1 << 16, 1 << 28
    cost.op_bytes.update({small: 10, large: 2})
    monkeypatch.setattr(xla_rates, "xla_dot_seconds", lambda dots, devices: {d: 0.5 * devices / 4 for d in dots})
    monkeypatch.setattr(xla_rates, "l2_cache_bytes", lambda: 2**21)
    monkeypatch.setattr(xla_rates, "xla_cpu_bandwidths",
                        lambda: xla_rates.cpu_rates.Rates({"cached": 40e9, "streaming": 10e9}, True, "test"))
    step = priced_step(cost, 8, "cpu", torch.float32)
    # the eight virtual devices' products timed running at once; their other ops one after another on the cores
    assert step["matmul_s"] == pytest.approx(3 * 0.5 * 8 / 4)
    assert step["memory_s"] == pytest.approx(8 * (10 * small / 40e9 + 2 * large / 10e9))


def test_each_matmul_is_timed_at_its_own_shape():
    import jax

    dots = [Dot((64, 32), (32, 16), "f32", "f32", "f32", (), (), (1,), (0,)),
            Dot((2, 8, 4), (2, 4, 8), "bf16", "bf16", "f32", (0,), (0,), (2,), (1,))]
    rates = xla_rates.measure_dot_flops(dots, seconds=0.01)
    assert len(rates) == 2 and all(1e5 < r < 1e14 for r in rates.values())
    assert len(xla_rates.measure_dot_flops(dots[:1], devices=len(jax.devices("cpu")), seconds=0.01)) == 1
    assert dots[1].flops == 2 * 2 * 8 * 8 * 4 == 2 * math.prod((2, 8, 8)) * 4


CALL_HLO = """HloModule m

%outlined (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  ROOT %sum = f32[256]{0} add(%a, %a)
}

ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %called = f32[256]{0} call(%x), to_apply=%outlined
}
"""


def test_an_outlined_computations_ops_count_as_the_callers():
    assert program_cost(CALL_HLO).op_bytes == {3 * 256 * 4: 1}


TUPLE_INDEX_HLO = """HloModule m

ENTRY %main (t: (f32[4], f32[8])) -> f32[8] {
  %t = (f32[4]{0}, /*index=1*/f32[8]{0}) parameter(0)
  ROOT %sum = f32[8]{0} add(%t#1, %t#1)
}
"""


def test_xlas_dumps_tuple_element_shorthand_reads_the_elements_type():
    # the files --xla_dump_to writes name a tuple's k-th element %t#k: its bytes are the element's, not the tuple's
    assert program_cost(TUPLE_INDEX_HLO).op_bytes == {3 * 8 * 4: 1}

