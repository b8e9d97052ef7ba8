"""Fixtures shared across the whole suite go here (a fixture is for what pytest must manage: a temporary
directory, a scope, a teardown). Plain helpers, the CLI runner, the metrics.jsonl reader and the tiny model's
overrides among them, are functions in tests/helpers.py, imported as `from tests.helpers import ...`
(pyproject's `pythonpath` puts the repository root on sys.path)."""

import os
from typing import Iterator

import pytest

from tests.object_store import S3Server, start_s3_server

# Every machine decides precision=auto alike (fp32 on a CPU): the suite's exact comparisons between layouts and
# against fp32 references do not depend on whether the CI machine's CPU has bf16 matmul instructions. The tests
# of the bf16 choice set it themselves (tests/hardware/test_hardware.py, tests/train/test_precision_auto.py).
os.environ["EMBER_CPU_BF16"] = "0"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 with authentication on, one IAM user's
    credentials and a bucket; stopped by pid at the end of the session."""
    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()
