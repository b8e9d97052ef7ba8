"""The plan against real runs on this CPU: for each small layout (ember.plan.measure.LAYOUTS: fsdp, HSDP,
tensor, context, remat=full, pipeline with each schedule and with FSDP, Mixtral expert=2, GPT 126M fsdp=2, on 2
and 4 ranks), every rank's planned
parameter, gradient and optimizer bytes equal the measured ones exactly and its planned peak is within 10%
of the peak measured by torch's MemTracker in the real training step (ember/plan/measure.py says how).
One torchrun job per world size (gloo, OMP_NUM_THREADS=1)."""

import pytest

from ember.plan.measure import LAYOUTS, compare, measure_layouts

PEAK_TOLERANCE = 0.10


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_planned_memory_equals_measured(world, tmp_path):
    measured = measure_layouts(world, LAYOUTS[world], tmp_path / f"world{world}.json")
    for name, overrides in LAYOUTS[world].items():
        rows = compare(world, name, overrides, measured[name])
        assert len(rows) == world
        for row in rows:
            for key in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert row[f"planned_{key}"] == row[f"measured_{key}"], (name, row["rank"], key)
            assert abs(row["peak_error"]) <= PEAK_TOLERANCE, (name, row)
