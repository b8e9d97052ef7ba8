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


# The longest tests, by their durations on the 2-core CI machine (pytest --durations), started first: with
# `-n 2` a long test left for the end runs alone while the other worker idles. The order changes no result;
# a test missing here only starts in its collection order.
LONGEST_FIRST = (
    "tests/test_cli.py::test_the_readme_plan_and_launch_examples_run_as_written",
    "tests/plan/test_plan_accuracy.py",
    "tests/plan/test_plan_cli.py::test_search_json_holds_the_candidates_the_table_lists",
    "tests/xla/test_xla_families.py",
    "tests/xla/test_xla_layouts.py",
    "tests/train/test_precision_auto.py::test_default_run_losses_under_auto_bf16_stay_within_one_percent_of_fp32",
    "tests/xla/test_xla_plan.py",
    "tests/xla/test_xla_checkpoint.py",
    "tests/storage/test_object_storage.py",
    "tests/storage/test_docs_on_s3.py",
    "tests/train/test_fault_tolerance.py",
    "tests/storage/test_data_on_s3.py",
    "tests/launch/test_slurm_replica_groups.py::test_a_requeued_group_heals_while_the_other_trains_on",
)


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their collection order
