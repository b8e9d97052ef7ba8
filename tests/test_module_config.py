"""Modules are configured at construction (issue 40): code outside a module's class does not set the attributes
that configure it or that hold its statistics. A MoE layer takes its router-loss weights, dispatch and statistics
collector as constructor options (nn/moe_stats.MoEOptions) and keeps no statistics; an attention's kernel is
chosen by nn/attention.set_attention_kernel alone. Read from the source with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Attributes of MoE, Attention/MLA and their former training bookkeeping, which only their own class may set.
GUARDED = {"aux_loss_coef", "z_loss_coef", "loss_weight_per_token", "dispatch", "_dispatch", "options",
           "stats_with_graph", "_step_loads", "step_load", "window_load", "aux_loss", "z_loss", "tokens_per_expert",
           "attention_fn", "impl", "kv_cache"}
# The one setter of the attention kernel: nn/attention.py's set_attention_kernel.
SETTER = ("ember/nn/attention.py", "set_attention_kernel")


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target)
    return flat


def settings_from_outside(path: Path, source: str) -> list[str]:
    """`file:line attr` for each assignment to a guarded attribute of an object other than `self` (and each
    setattr of one), outside the one kernel setter."""
    tree = ast.parse(source, filename=str(path))
    relative = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    allowed: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and (relative, fn.name) == SETTER:
            allowed.update(id(n) for n in ast.walk(fn))
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        for target in _targets(node):
            if (isinstance(target, ast.Attribute) and target.attr in GUARDED
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                found.append(f"{relative}:{node.lineno} .{target.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in GUARDED):
            found.append(f"{relative}:{node.lineno} setattr {node.args[1].value}")
    return found


# The collector's own records (LayerStats: aux_loss, step_load, ...) are its to write; they are no module's.
COLLECTOR = ROOT / "ember" / "nn" / "moe_stats.py"


def test_no_module_attribute_is_set_from_outside_its_class():
    files = sorted(p for p in [*(ROOT / "ember").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")] if p != COLLECTOR)
    found = [hit for path in files for hit in settings_from_outside(path, path.read_text())]
    assert not found, f"set from outside the module's class (pass it at construction instead): {found}"


def test_the_check_finds_what_the_engines_did_before():
    # what xla/step.py and parallel/cp.py did before the options were constructor arguments
    before = ("moe.dispatch = fn\nmoe.aux_loss_coef = moe.z_loss_coef = 0.0\nmoe._step_loads.clear()\n"
              "moe.aux_loss, moe.z_loss, moe.tokens_per_expert = a, z, c\nblock.attention.attention_fn = fn\n"
              "self.attention_fn = fn\nsetattr(m, 'stats_with_graph', True)\n")
    assert settings_from_outside(Path("ember/xla/step.py"), before) == [
        "ember/xla/step.py:1 .dispatch", "ember/xla/step.py:2 .z_loss_coef", "ember/xla/step.py:2 .aux_loss_coef",
        "ember/xla/step.py:4 .tokens_per_expert", "ember/xla/step.py:4 .z_loss", "ember/xla/step.py:4 .aux_loss",
        "ember/xla/step.py:5 .attention_fn", "ember/xla/step.py:7 setattr stats_with_graph"]
