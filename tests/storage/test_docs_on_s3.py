"""docs/checkpoints.md's TPU run on a bucket, as written, against the local S3 server (moto on 127.0.0.1): gs://my-bucket
becomes the server's bucket (s3://), the 8 chips are 8 virtual CPU devices of jax."""

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers import job_env, run_ember
from tests.object_store import BUCKET

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


def _doc_commands() -> list[list[str]]:
    """The `ember ...` lines of the doc's bash blocks that name gs://my-bucket, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    lines = [line for block in blocks for line in block.splitlines() if "gs://my-bucket" in line]
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("ember ")]


def test_the_tpu_run_on_a_bucket_runs_as_written(s3_server, tmp_path):
    commands = _doc_commands()
    assert [c[0] for c in commands] == ["train", "train", "report", "generate"], commands
    env = job_env(**s3_server.env(EMBER_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
                                  XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    outputs = []
    for argv in commands:
        argv = [arg.replace("gs://my-bucket", f"s3://{BUCKET}/docs") for arg in argv]
        proc = run_ember(*argv, env=env, cwd=tmp_path, timeout=1200)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
        outputs.append(proc.stdout + proc.stderr)
    url = f"s3://{BUCKET}/docs/runs/debug-tpu"
    assert f"resumed from {url}/checkpoints/step-20 (step 20)" in outputs[1]
    steps = {Path(p).name for p in s3_server.filesystem().ls(f"{BUCKET}/docs/runs/debug-tpu/checkpoints")}
    assert "step-40" in steps
    assert f"{url}/report.html" in outputs[2], outputs[2]  # the page written beside the run, on the store
    assert s3_server.filesystem().exists(f"{BUCKET}/docs/runs/debug-tpu/report.html")
    assert outputs[3].startswith("def main("), outputs[3][:200]
