"""What a compiled XLA program does per device, read from its optimized HLO: each matmul (its shapes, dtype and
how many times it runs), the bytes every other top-level op moves, and the bytes its collectives produce.

Read from the text because XLA's own cost analysis (`Compiled.cost_analysis()`) counts a while loop's body once,
and ember's scanned layers, gradient accumulation and remat live in while loops: a 12-layer scan's FLOPs came out
a twelfth of the step's. Here a body's ops count as many times as its loop's known trip count. The program is the
one the planned run compiles (the same shardings and shapes), so the matmuls are exactly the step's, remat's
recomputation included; the bytes are the CPU compiler's fusions, which a TPU's compiler draws differently.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# HLO's names of the dtypes a matmul takes, as numpy (ml_dtypes) names them
NUMPY_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s8": "int8", "u8": "uint8",
                "s32": "int32", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_PARAMETER = re.compile(r"(\S+): (\([^)]*\)|\S+?)(?:, |$)")
# ops that move no data of their own (views, tuples, loop plumbing)
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id",
        "replica-id", "iota", "opt-barrier", "add-dependency"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast")


@dataclass(frozen=True)
class Dot:
    """One matmul as XLA runs it: operand shapes and dtypes, the output dtype, and the dimension numbers."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]

    @property
    def out_elements(self) -> int:
        kept_lhs = math.prod(d for i, d in enumerate(self.lhs) if i not in self.lhs_contracting)
        return kept_lhs * math.prod(d for i, d in enumerate(self.rhs) if i not in self.rhs_contracting + self.rhs_batch)

    @property
    def flops(self) -> int:
        return 2 * self.out_elements * math.prod(self.lhs[i] for i in self.lhs_contracting)

    @property
    def nbytes(self) -> int:
        """Its operands' and output's bytes."""
        return (DTYPE_BYTES[self.lhs_dtype] * math.prod(self.lhs) + DTYPE_BYTES[self.rhs_dtype] * math.prod(self.rhs)
                + DTYPE_BYTES[self.out_dtype] * self.out_elements)

    def describe(self) -> str:
        return f"{self.lhs_dtype}{list(self.lhs)} x {self.rhs_dtype}{list(self.rhs)}"


@dataclass
class ProgramCost:
    """Per device, per execution of the program: `dots` (each distinct matmul and how many times it runs),
    `op_bytes` (each top-level op's bytes read and written, and how many times an op of that size runs) and
    `collective_bytes` (what the collectives produce)."""

    dots: Counter = field(default_factory=Counter)
    op_bytes: Counter = field(default_factory=Counter)
    collective_bytes: int = 0

    @property
    def dot_flops(self) -> int:
        return sum(dot.flops * n for dot, n in self.dots.items())

    @property
    def memory_bytes(self) -> int:
        return sum(size * n for size, n in self.op_bytes.items())


def shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def nbytes(text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements summed)."""
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in shapes(text))


@dataclass
class _Instruction:
    name: str
    type: str
    op: str
    operands: list[str]
    attributes: str
    root: bool


@dataclass
class _Computation:
    instructions: list[_Instruction] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)  # every value's HLO type, parameters' included

    @property
    def root(self) -> _Instruction:
        return next(i for i in self.instructions if i.root)

    def type_of(self, name: str) -> str:
        """A value's type; `%t#k`, the k-th element of tuple `%t` (XLA's dumps write get-tuple-element so)."""
        if name in self.types:
            return self.types[name]
        base, _, index = name.rpartition("#")
        if base not in self.types or not index.isdigit():
            return ""
        inner, depth, elements, start = self.types[base][1:-1], 0, [], 0
        for i, ch in enumerate(inner):  # the tuple's top-level elements
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 0:
                elements.append(inner[start:i])
                start = i + 1
        elements.append(inner[start:])
        return elements[int(index)] if int(index) < len(elements) else ""


def _split_call(rest: str) -> tuple[str, str]:
    """`a, b), attr=...` -> ("a, b", ", attr=..."): an op's operands and its attributes."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return rest[:i], rest[i + 1:]
            depth -= 1
    return rest, ""


def parse(text: str) -> tuple[dict[str, _Computation], str]:
    """The computations of an HLO module's text (Compiled.as_text()) by name, and the entry's name."""
    computations: dict[str, _Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations[head[2]] = _Computation()
            entry = head[2] if head[1] else entry
            current.types.update((m[1], m[2]) for m in _PARAMETER.finditer(head[3]))
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            operands, attributes = _split_call(m[5])
            inst = _Instruction(m[2], m[3], m[4], re.findall(r"%([\w.\-#]+)", operands), attributes, bool(m[1]))
            current.instructions.append(inst)
            current.types[inst.name] = inst.type
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _attribute(inst: _Instruction, name: str) -> str:
    found = re.search(name + r"=%([\w.\-]+)", inst.attributes)
    if found is None:
        raise ValueError(f"HLO op {inst.name} ({inst.op}) has no {name}")
    return found[1]


def _dims(inst: _Instruction, name: str) -> tuple[int, ...]:
    found = re.search(name + r"=\{([0-9,]*)\}", inst.attributes)
    return tuple(int(d) for d in found[1].split(",") if d) if found else ()


def _trip_count(inst: _Instruction) -> int:
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attributes)
    if found is None:  # XLA knows the count of every loop ember writes (scans, accumulation): a new kind is said
        raise ValueError(f"while loop {inst.name} has no known trip count: its cost cannot be counted")
    return int(found[1])


def _dot(comp: _Computation, inst: _Instruction) -> Dot:
    (lhs_dtype, lhs), = shapes(comp.type_of(inst.operands[0]))
    (rhs_dtype, rhs), = shapes(comp.type_of(inst.operands[1]))
    return Dot(lhs, rhs, lhs_dtype, rhs_dtype, shapes(inst.type)[0][0], _dims(inst, "lhs_batch_dims"),
               _dims(inst, "rhs_batch_dims"), _dims(inst, "lhs_contracting_dims"), _dims(inst, "rhs_contracting_dims"))


def _fusion_bytes(fused: _Computation, comp: _Computation, inst: _Instruction) -> int:
    """A fusion's bytes at its boundary: its operands read and its output written, less what it only slices of an
    operand (dynamic-slice reads the slice) or updates in place (dynamic-update-slice writes the update)."""
    users: dict[str, list[_Instruction]] = {}
    for i in fused.instructions:
        for name in i.operands:
            users.setdefault(name, []).append(i)
    root = fused.root
    in_place = root.op == "dynamic-update-slice"
    read = sum(nbytes(comp.type_of(name)) for name in inst.operands)
    for param in (i for i in fused.instructions if i.op == "parameter"):
        used = users.get(param.name, [])
        if used and all(u.op in ("dynamic-slice", "slice") and u.operands[0] == param.name for u in used):
            read -= nbytes(param.type) - sum(nbytes(u.type) for u in used)
        elif in_place and root.operands[0] == param.name and len(used) == 1:
            read -= nbytes(param.type)
    written = nbytes(fused.types[root.operands[1]]) if in_place else nbytes(inst.type)
    return max(read, 0) + written


def program_cost(text: str) -> ProgramCost:
    """The per-device cost of the program whose optimized HLO is `text`."""
    computations, entry = parse(text)
    cost = ProgramCost()

    def dots_inside(name: str, times: int) -> bool:
        found = False
        for inst in computations[name].instructions:
            if inst.op == "dot":
                cost.dots[_dot(computations[name], inst)] += times
                found = True
            elif inst.op == "fusion":
                found = dots_inside(_attribute(inst, "calls"), times) or found
        return found

    def visit(name: str, times: int) -> None:
        comp = computations[name]
        for inst in comp.instructions:
            if inst.op in FREE or inst.op.endswith("-done"):
                continue
            if inst.op == "while":
                visit(_attribute(inst, "body"), times * _trip_count(inst))
            elif inst.op == "dot":
                cost.dots[_dot(comp, inst)] += times
            elif inst.op == "call":  # an outlined computation: its ops run as the caller's would
                visit(_attribute(inst, "to_apply"), times)
            elif inst.op == "fusion":
                called = _attribute(inst, "calls")
                if not dots_inside(called, times):  # a matmul's fusion is priced as its matmul
                    cost.op_bytes[_fusion_bytes(computations[called], comp, inst)] += times
            elif inst.op.startswith(COLLECTIVES):
                cost.collective_bytes += times * nbytes(inst.type)
            else:
                cost.op_bytes[nbytes(inst.type) + sum(nbytes(comp.type_of(o)) for o in inst.operands)] += times

    visit(entry, 1)
    return cost
