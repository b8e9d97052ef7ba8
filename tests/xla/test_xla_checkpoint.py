"""device=xla checkpoints are ember checkpoints: a killed run resumes bit for bit, resumes on another mesh and
on the torch path, and converts to a Hugging Face directory whose logits equal ember's; and the XLA path's
mistakes are one line with exit 2."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import job_env, losses_by_step, run_ember, tiny_model

BASE = ["debug", *tiny_model(2), "seq_len=32", "global_batch_size=8", "max_steps=8", "logging_steps=1",
        "metrics.console=false", "eval_batches=1", "checkpoint.interval=4", "checkpoint.async_save=false"]
FSDP8 = ["device=xla", "ici_mesh.fsdp=8", "micro_batch_size=1"]
KILL = """
import os
if os.environ.get("EMBER_KILL_AT_STEP"):
    import signal
    import ember.train.trainer as t
    original = t.Trainer.train_step
    def train_step(self, batches):
        if self.step == int(os.environ["EMBER_KILL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batches)
    t.Trainer.train_step = train_step
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted xla run, and the same run killed at step 6 then resumed (from step-4)."""
    from tests.xla.conftest import XLA_ENV

    root = tmp_path_factory.mktemp("xla_ckpt")
    env = job_env(**XLA_ENV)
    run_ember("train", *BASE, *FSDP8, f"output_dir={root / 'whole'}", env=env, expect=0)
    inject = root / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILL)
    killed = dict(env, PYTHONPATH=os.pathsep.join([str(inject), env.get("PYTHONPATH", "")]), EMBER_KILL_AT_STEP="6")
    proc = run_ember("train", *BASE, *FSDP8, f"output_dir={root / 'killed'}", env=killed)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (root / "killed" / "checkpoints" / "step-4" / "model.json").is_file()
    run_ember("train", *BASE, *FSDP8, f"output_dir={root / 'killed'}", env=env, expect=0)
    return {"whole": root / "whole", "killed": root / "killed", "root": root}


@pytest.mark.slow
def test_a_killed_run_resumes_bit_exact(runs: dict):
    whole, resumed = losses_by_step(runs["whole"]), losses_by_step(runs["killed"])
    assert [resumed[s] for s in range(5, 9)] == [whole[s] for s in range(5, 9)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["device=xla", "ici_mesh.fsdp=4", "ici_mesh.tensor=2", "micro_batch_size=2"],
                                    ["device=cpu", "micro_batch_size=8"]], ids=["fsdp4_tensor2", "torch_cpu"])
def test_a_checkpoint_resumes_on_another_mesh_and_on_the_torch_path(runs: dict, layout: list, xla_env: dict,
                                                                   tmp_path: Path):
    step4 = runs["whole"] / "checkpoints" / "step-4"
    run_ember("train", *BASE, *layout, f"output_dir={tmp_path / 'run'}", f"resume={step4}", env=xla_env, expect=0)
    whole, resumed = losses_by_step(runs["whole"]), losses_by_step(tmp_path / "run")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step][0] == pytest.approx(whole[step][0], rel=1e-5)


@pytest.mark.slow
def test_convert_to_hf_gives_transformers_the_same_logits(runs: dict, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from ember.model_io.load import load_model

    step8 = runs["whole"] / "checkpoints" / "step-8"
    run_ember("convert", str(step8), str(tmp_path / "hf"), "--to", "hf", env=job_env(), expect=0)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = load_model(str(step8)).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, says", [
    (["device=tpu"], "not TPUs"),
    (["device=xla", "ici_mesh.fsdp=3"], "world size is 8; make the axes multiply to jax's 8 device(s) (or set one "
                                        "axis to -1); on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N"),
    (["device=xla", "model.remat=offload", "micro_batch_size=1"],
     "model.remat=offload needs a TPU's or GPU's pinned host memory, and jax's devices are cpu; use model.remat=full"),
])
def test_mistakes_are_one_line_with_exit_2(overrides: list, says: str, xla_env: dict, tmp_path: Path):
    proc = run_ember("train", "debug", *overrides, f"output_dir={tmp_path / 'run'}", env=xla_env, expect=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_without_the_extra_device_xla_says_what_to_install(xla_env: dict, tmp_path: Path):
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('No module named jax')\n")
    env = dict(xla_env, PYTHONPATH=os.pathsep.join([str(tmp_path), xla_env.get("PYTHONPATH", "")]))
    proc = run_ember("train", "debug", "device=xla", f"output_dir={tmp_path / 'run'}", env=env, expect=2)
    assert proc.stderr.strip().splitlines() == [
        "error: device=tpu|xla needs jax and torchax, which are not installed: pip install -e '.[tpu]' "
        "torch==2.13.0 (on a TPU VM also: pip install 'jax[tpu]')"]


@pytest.mark.slow
def test_a_resume_keeps_the_dtype_the_run_trained_in_as_on_the_torch_engine(tmp_path: Path, xla_env: dict):
    """precision=auto on a resumed run is ember.train.run.choose_precision's decision on both engines: the XLA path's
    auto (fp32 on jax's CPU devices) does not switch a run that trained in bf16."""
    import json

    out = tmp_path / "run"
    run_ember("train", *BASE, *FSDP8, "max_steps=4", "precision=bf16", f"output_dir={out}", env=xla_env, expect=0)
    proc = run_ember("train", *BASE, *FSDP8, "max_steps=5", "metrics.console=true", f"output_dir={out}", env=xla_env,
                     expect=0)
    assert "precision: auto -> bf16 autocast (kept from the run this resumes, run.json's compute" in proc.stdout
    assert json.loads((out / "run.json").read_text())["compute"] == "bfloat16"
