"""Fixtures shared across the whole suite go here (a fixture is for what pytest must manage: a temporary
directory, a scope, a teardown). Plain helpers, the CLI runner, the metrics.jsonl reader and the tiny model's
overrides among them, are functions in tests/helpers.py, imported as `from tests.helpers import ...`
(pyproject's `pythonpath` puts the repository root on sys.path)."""

import os

# Every machine decides precision=auto alike (fp32 on a CPU): the suite's exact comparisons between layouts and
# against fp32 references do not depend on whether the CI machine's CPU has bf16 matmul instructions. The tests
# of the bf16 choice set it themselves (tests/hardware/test_hardware.py, tests/train/test_precision_auto.py).
os.environ["EMBER_CPU_BF16"] = "0"
