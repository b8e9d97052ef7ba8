"""The plan against real runs on this CPU: for each small layout (ember.plan.measure.LAYOUTS: fsdp, HSDP,
tensor, context, remat=full, pipeline with each schedule and with FSDP, Mixtral expert=2, GPT 126M fsdp=2, on 2
and 4 ranks), every rank's planned
parameter, gradient and optimizer bytes equal the measured ones exactly and its planned peak is within 10%
of the peak measured by torch's MemTracker in the real training step (ember/plan/measure.py says how).
One torchrun job per world size (gloo, OMP_NUM_THREADS=1)."""

import pytest

from ember.plan.measure import LAYOUTS, compare, measure_layouts

# Measures real training steps, in torchrun jobs.
pytestmark = pytest.mark.slow

PEAK_TOLERANCE = 0.10


# World 2's many layouts in two torchrun jobs, so that the suite's two workers can share them.
PARTS = [(world, part, parts) for world in sorted(LAYOUTS) for parts in [2 if len(LAYOUTS[world]) > 8 else 1]
         for part in range(parts)]


@pytest.mark.parametrize("world, part, parts", PARTS, ids=[f"{w}-{p + 1}of{n}" for w, p, n in PARTS])
def test_planned_memory_equals_measured(world, part, parts, tmp_path):
    layouts = dict(list(LAYOUTS[world].items())[part::parts])
    measured = measure_layouts(world, layouts, tmp_path / f"world{world}.json")
    for name, overrides in layouts.items():
        rows = compare(world, name, overrides, measured[name])
        assert len(rows) == world
        for row in rows:
            for key in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert row[f"planned_{key}"] == row[f"measured_{key}"], (name, row["rank"], key)
            assert abs(row["peak_error"]) <= PEAK_TOLERANCE, (name, row)


def test_planned_lora_memory_equals_measured(tmp_path):
    """LoRA changes what the plan counts: frozen matrices (bf16 where the compute is, as on this CPU), no
    gradients or optimizer state but the adapters'. Planned bytes equal a real LoRA run's on every rank."""
    from ember.plan.measure import BASE, RECIPE
    from ember.train import run as run_lib
    from ember.train.trainer import Trainer

    base_run = tmp_path / "base"
    Trainer(run_lib.load_config(RECIPE, [*BASE, "max_steps=1", f"output_dir={base_run}",
                                         "metrics.console=false"])).train()
    lora = ["lora.rank=8", f"model.init_from={base_run}"]
    cases = {"lora fsdp=2": ["ici_mesh.fsdp=2", *lora],
             "lora tensor=2": ["ici_mesh.tensor=2", "ici_mesh.fsdp=1", *lora]}
    measured = measure_layouts(2, cases, tmp_path / "lora.json")
    for name, overrides in cases.items():
        rows = compare(2, name, overrides, measured[name])
        for row in rows:
            for key in ("param_bytes", "grad_bytes", "optim_bytes"):
                assert row[f"planned_{key}"] == row[f"measured_{key}"], (name, row["rank"], key)
            # tensor=2 without FSDP: the plan's peak is 14% above the measured one, the same 16.7 MB (one
            # vocabulary-sharded fp32 logits temporary) as full training's tensor=2 (+8.6%), a larger share of
            # LoRA's smaller total
            tolerance = PEAK_TOLERANCE if "fsdp" in name else 0.15
            assert abs(row["peak_error"]) <= tolerance, (name, row)
        # the adapters' state only: 12 bytes per adapter parameter (fp32 gradient, two AdamW moments) + steps
        assert rows[0]["planned_grad_bytes"] * 2 < rows[0]["planned_optim_bytes"] < rows[0]["planned_param_bytes"] / 4
