"""`ember plan` on the XLA path: the compiled step's per-device memory (XLA's memory analysis of abstract arrays on
virtual devices) against the same analysis of the step a real device=xla run compiled over its arrays, and the
step's time priced from the same program."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_ember, tiny_model

LAYOUT = ["device=xla", *tiny_model(2), "seq_len=64", "global_batch_size=8", "ici_mesh.fsdp=4", "ici_mesh.tensor=2",
          "micro_batch_size=2", "metrics.console=false"]
RUN_AND_MEASURE = """
import json, sys
from ember.train import run as run_lib
from ember.xla.layout import compiled_memory
from ember.train.trainer import Trainer
cfg = run_lib.load_config("debug", sys.argv[1:])
trainer = Trainer(cfg)
trainer.train()
spec, engine = trainer.spec, trainer.engine
print(json.dumps(compiled_memory(engine.layout, spec.grad_accum, cfg.micro_batch_size * spec.shape.dp, cfg.seq_len,
                                 params=engine.params, opt_state=engine.opt_state)))
"""


@pytest.mark.slow
def test_the_plan_predicts_the_compiled_steps_memory(xla_env: dict, tmp_path: Path):
    proc = subprocess.run([sys.executable, "-c", RUN_AND_MEASURE, *LAYOUT, "max_steps=2",
                           f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=xla_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    planned = json.loads(run_ember("plan", "debug", *LAYOUT, "--world", "8", "--device", "cpu", "--json",
                                   env=xla_env, expect=0).stdout)
    assert planned["xla_memory"]["peak"] == pytest.approx(measured["peak"], rel=0.10)
    assert planned["xla_memory"]["arguments"] == pytest.approx(measured["arguments"], rel=0.10)
    one = json.loads(run_ember("plan", "debug", *[o for o in LAYOUT if not o.startswith("ici_mesh")],
                               "micro_batch_size=8", "--world", "1", "--device", "cpu", "--json",
                               env=xla_env, expect=0).stdout)
    # weights and AdamW moments sharded 8 ways: an eighth of one device's, to within the replicated scalars
    assert planned["xla_memory"]["arguments"] == pytest.approx(one["xla_memory"]["arguments"] / 8, rel=0.02)
    # the step's matmuls split over fsdp=4 x tensor=2 with nothing computed twice: each device an eighth, exactly
    assert planned["xla_step"]["matmul_flops"] * 8 == one["xla_step"]["matmul_flops"] > 0
    for plan in (planned, one):  # priced on this CPU: the parts add up to the step
        step = plan["xla_step"]
        assert step["step_s"] == pytest.approx(step["matmul_s"] + step["memory_s"] + step["collective_s"])
        assert step["matmul_s"] > 0 and step["memory_s"] > 0 and "XLA:CPU" in step["priced_by"]
    assert planned["xla_step"]["collective_bytes"] > 0 == one["xla_step"]["collective_bytes"]


@pytest.mark.slow
def test_plan_for_a_tpu_device_reports_the_xla_path_and_its_verdict(xla_env: dict):
    out = run_ember("plan", "debug", "device=xla", "ici_mesh.fsdp=8", "micro_batch_size=1", "--world", "8",
                    "--device", "tpu-v6e", env=xla_env, expect=0).stdout
    assert "XLA path (device=tpu|xla): the compiled step per device" in out and "verdict: fits" in out
    assert "XLA path step, priced op by op from the compiled program" in out and "TPU v6e's datasheet rates" in out


@pytest.mark.slow
def test_a_moe_step_is_not_priced_for_a_tpu_from_the_cpu_program(xla_env: dict, tmp_path: Path):
    # XLA:CPU runs ragged_dot densely over every expert: that program would price a TPU's MoE step many times over
    out = run_ember("plan", "qwen3-30b-a3b", "device=xla", "model.n_layers=2", "seq_len=128", "global_batch_size=8",
                    "micro_batch_size=1", "ici_mesh.fsdp=1", "ici_mesh.expert=8", "--world", "8", "--device",
                    "tpu-v6e", "--output", str(tmp_path / "plan.json"), env=xla_env, expect=0).stdout
    assert "mixture-of-experts step is not priced" in " ".join(out.split()) and "XLA path step, priced" not in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "xla_step" not in plan and plan["xla_memory"]["peak"] > 0
