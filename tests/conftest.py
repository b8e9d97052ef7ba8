"""Fixtures shared across the whole suite go here (a fixture is for what pytest must manage: a temporary
directory, a scope, a teardown). Plain helpers, the CLI runner, the metrics.jsonl reader and the tiny model's
overrides among them, are functions in tests/helpers.py, imported as `from tests.helpers import ...`
(pyproject's `pythonpath` puts the repository root on sys.path)."""
