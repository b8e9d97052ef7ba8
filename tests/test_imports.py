"""The package's dependency rules, read from the source with `ast` (nothing is imported):
- no import cycle between ember's modules, counting imports inside functions too (a lazy import that
  closes a cycle is still a cycle a reader has to untangle);
- model code and ember/nn are single-device PyTorch: no torch.distributed;
- ember/nn never imports ember.data (shared constants live in ember/constants.py);
- ember/report loads no torch (`import torch` loads torch.distributed): it reads files;
- ember/model_io/load.py imports nothing of ember/finetune (fine-tuning registers its formats with
  ember/model_io/sources.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ember"
MODULES = {
    ".".join(("ember", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
}


def _imports(module: str) -> set[str]:
    """Every module `module` imports, anywhere in the file (not only at the top)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..nn import y
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:  # `from ember.data import packing` names a module, not a value
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


GRAPH = {module: {m for m in _imports(module) if m in MODULES and m != module} for module in MODULES}


def _find_cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_is_read():
    assert "ember.train.trainer" in GRAPH and "ember.train.step" in GRAPH["ember.train.trainer"]
    assert "ember.nn.moe" in GRAPH["ember.nn.decoder"]


def test_no_import_cycles():
    cycle = _find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


SINGLE_DEVICE = sorted(m for m in MODULES if m == "ember.nn" or m.startswith("ember.nn.")
                       or (m.startswith("ember.models.") and m.endswith(".model")))


def _uses_torch_distributed(module: str) -> bool:
    """`import torch.distributed`, `from torch import distributed` or `torch.distributed.x` anywhere in the file."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and (
            node.module.startswith("torch.distributed")
            or (node.module == "torch" and any(a.name == "distributed" for a in node.names))
        ):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "distributed" and ast.unparse(node.value) == "torch":
            return True
    return False


@pytest.mark.parametrize("module", SINGLE_DEVICE)
def test_model_code_is_single_device(module: str):
    assert not _uses_torch_distributed(module), f"{module} uses torch.distributed"
    if not module.startswith("ember.models."):
        assert not {m for m in _imports(module) if m.startswith("ember.data")}, f"{module} imports ember.data"


def _top_level_imports(module: str) -> set[str]:
    """What importing `module` imports at once: its module body's imports (in `if`/`try` blocks and class
    bodies too), not those inside its functions."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    nodes = list(ast.parse(path.read_text(), filename=str(path)).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from torch import distributed`
            found.add(base)
        nodes.extend(ast.iter_child_nodes(node))
    return found


def _loaded_by(modules: set[str]) -> set[str]:
    """Every module that importing `modules` loads: the packages above each, and the top-level imports of
    every ember module among them, followed through ember (a third-party module counts as itself)."""
    loaded: set[str] = set()
    todo = set(modules)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            if name not in loaded:
                loaded.add(name)
                if name in MODULES:
                    todo.update(_top_level_imports(name) - loaded)
    return loaded


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m == "ember.report" or m.startswith("ember.report.")))
def test_report_reads_files_without_torch_distributed(module: str):
    """`ember report` reads a run's files: nothing it loads, at import or in its functions (their lazy imports
    and everything those load), is torch.distributed, or torch itself (`import torch` loads torch.distributed)."""
    loaded = _loaded_by({module} | _imports(module))
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}, f"{module} loads torch"


def test_the_report_check_follows_imports_through_ember():
    # Pins the checker itself: mesh.py imports torch.distributed, train.py torch; mesh_shape.py is plain arithmetic.
    assert "torch.distributed" in _loaded_by({"ember.parallel.mesh"}) and "torch" in _loaded_by({"ember.train.trainer"})
    assert "torch" not in _loaded_by({"ember.parallel.mesh_shape"})


def test_config_imports_nothing_of_ember_but_its_schema():
    """Config loading and merging (ember/config.py) depend on the schema and its errors only, anywhere in the file:
    the checks that need a feature's code live with the feature (ember.train.run.load_config calls them)."""
    ember_imports = {m for m in _imports("ember.config") if m == "ember" or m.startswith("ember.")}
    assert ember_imports <= {"ember.config_schema", "ember.overrides", "ember.errors"}, ember_imports
    assert {m for m in _loaded_by({"ember.config"}) if m in MODULES} - {"ember"} <= {
        "ember.config", "ember.config_schema", "ember.overrides", "ember.errors"}


JAX = ("jax", "jaxlib", "torchax", "optax")


def _names_jax(imported: set[str]) -> set[str]:
    return {m for m in imported if m.split(".")[0] in JAX}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(("ember.nn", "ember.models"))))
def test_model_code_imports_no_jax(module: str):
    """Models and nn/ are plain PyTorch on every path: the XLA path (ember/xla/) runs them unchanged."""
    assert not _names_jax(_imports(module)), f"{module} imports jax"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("ember.xla")))
def test_only_the_xla_package_imports_jax(module: str):
    """jax, torchax and optax are the .[tpu] extra: outside ember/xla/ nothing imports them, and what imports
    ember.xla does so inside a function, for device=tpu|xla only (ember.xla.checks and runtime excepted:
    checks imports no jax, runtime only inside functions)."""
    assert not _names_jax(_imports(module)), f"{module} imports jax"
    top = _top_level_imports(module)
    assert not {m for m in top if m.startswith("ember.xla")}, f"{module} imports ember.xla at import time"


def test_the_xla_entry_points_import_jax_only_inside_functions():
    for module in ("ember.xla.runtime", "ember.xla.checks", "ember.xla.mesh"):
        assert not _names_jax(_top_level_imports(module)), f"{module} imports jax at import time"


def test_the_run_and_the_trainer_name_no_engine():
    """ember.train.run, the Trainer and the TPU launcher reach an engine through ember/train/engines.py's registry (a
    module path per device): none imports ember/xla, the torch engine, or the registry's entries, anywhere in the
    file (the XLA rules are called from one place)."""
    for module in ("ember.train.run", "ember.train.trainer", "ember.commands.train", "ember.launch.tpu"):
        named = {m for m in _imports(module) if m.startswith("ember.xla") or m == "ember.train.torch_engine"}
        assert not named, (module, named)


def test_no_class_subclasses_the_trainer():
    """One Trainer for every engine: what differs is an engine's, never a subclass that replaces the build."""
    subclasses = [f"{module}.{node.name}" for module, path in MODULES.items()
                  for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                  if isinstance(node, ast.ClassDef)
                  and any(getattr(base, "id", getattr(base, "attr", None)) == "Trainer" for base in node.bases)]
    assert subclasses == []


def test_loading_imports_nothing_of_finetune():
    """ember/model_io/load.py and the source-format registry it reads (ember/model_io/sources.py) name no fine-tuning
    module in an import, anywhere in the file, and importing ember.model_io.load loads none: LoRA checkpoints, peft
    adapters and base fingerprints reach loading as "module:attribute" entries of ember.model_io.sources.FORMATS."""
    for module in ("ember.model_io.load", "ember.model_io.sources"):
        named = {m for m in _imports(module) if m.startswith("ember.finetune")}
        assert not named, (module, named)
    loaded = _loaded_by({"ember.model_io.load", "ember.model_io.sources"} | _imports("ember.model_io.load")
                        | _imports("ember.model_io.sources"))
    assert not {m for m in loaded if m.startswith("ember.finetune")}
    assert "ember.model_io.load" in GRAPH["ember.finetune.sources"]  # the dependency points from fine-tuning to loading


def test_benchmarks_import_nothing_of_the_tests():
    """Tests may import benchmarks; a benchmark never imports the test suite (it runs from a fresh clone alone)."""
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    offenders = []
    for path in sorted(benchmarks.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {name}" for name in names if name == "tests" or name.startswith("tests.")]
    assert offenders == []
