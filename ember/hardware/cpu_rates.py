"""What this machine's CPU matmuls run at, measured once and kept in the ember cache: the matmul peak that CPU
MFU divides by, and the fp32 and bf16 rates at one model's own GEMM shapes that precision=auto chooses by.

A CPU's flags do not say which dtype is faster: an Intel Xeon with AVX512-BF16 but no AMX runs torch's bf16
matmuls at 0.5-0.7x of fp32, a Sapphire Rapids (AMX) or an AVX512-BF16 EPYC at 1.5-4x, and the ratio moves with
the shapes (a (tokens, dim) x (dim, hidden) GEMM of a small model is not a 2048^3 one). So the rates are measured,
at the shapes that will run, and the same answer is reused by every rank and every run on the machine.

Every figure is keyed by (CPU model, torch threads, torch version), measured under a file lock (the ranks of a
node that start together measure once), and checked for contention: a measurement during which other processes
kept cores busy is provisional, used by the job that made it, measured again by the next job (the higher figure
kept: contention only lowers a rate) until a quiet measurement settles it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ember.constants import default_cache_dir

MATMUL_SIZES = (512, 1024, 2048)  # beyond the cache-resident sizes that measure higher than any layer gets


def measure_cpu_matmul_flops(seconds: float = 0.6, sizes: tuple[int, ...] = MATMUL_SIZES,
                             dtype: torch.dtype = torch.float32) -> float:
    """The best FLOP/s of n x n `dtype` matmuls on all of torch's CPU threads, over `sizes`, ~`seconds` each.

    The best run, not the mean: the peak is what the machine can do, and other processes on a shared host
    only ever make a run slower. Several sizes because BLAS kernels peak at different shapes on different
    CPUs; each gets a warm-up (thread pool start, first touch of the output) outside the timing.
    """
    best = 0.0
    for n in sizes:
        a, b, out = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)
        deadline = time.perf_counter() + seconds
        while True:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            end = time.perf_counter()
            best = max(best, 2 * n**3 / (end - start))  # a multiply and an add per inner-product term
            if end >= deadline:
                break
    return best


# --- A model's GEMMs --------------------------------------------------------------------------------------------

# Each dimension of a timed GEMM is capped here: past it a CPU's per-FLOP rate no longer changes much, and an 8B
# model's (8192 tokens, 4096) x (4096, 128256) output GEMM would take seconds per dtype to time.
GEMM_DIM_CAP = 2048


@dataclass(frozen=True, order=True)
class Gemm:
    """(tokens, in_features) x (in_features, out_features), `count` times per forward."""

    tokens: int
    in_features: int
    out_features: int
    count: int = 1

    def describe(self) -> str:
        return f"{self.tokens}x{self.in_features}x{self.out_features}*{self.count}"


def model_gemms(model: nn.Module, tokens: int) -> list[Gemm]:
    """The matmuls `model` runs on `tokens` rows (a micro-batch's tokens; a decode step's batch): one per weight
    matrix, as (out, in) in its last two dims (nn.Linear's and the experts' layout; an embedding table's
    (vocab, dim) is its output projection when tied or used as one), counted per weight, dims capped at
    GEMM_DIM_CAP. `model` may be on the meta device: only shapes are read."""
    counts: dict[tuple[int, int, int], int] = {}
    for param in model.parameters():
        if param.dim() < 2:
            continue
        out_features, in_features = param.shape[-2:]
        key = tuple(min(n, GEMM_DIM_CAP) for n in (tokens, in_features, out_features))
        counts[key] = counts.get(key, 0) + 1
    return sorted(Gemm(*key, count) for key, count in counts.items())


def measure_gemm_rates(gemms: list[Gemm], dtypes: tuple[torch.dtype, ...], training: bool = True,
                       seconds: float = 0.06, repeats: int = 5) -> dict[torch.dtype, float]:
    """FLOP/s of the matmuls over `gemms` in each dtype: each GEMM's forward product and, `training`, the two of
    its backward ((tokens, out) x (out, in) for the input's gradient, (in, tokens) x (tokens, out) for the
    weight's), the best of at least `repeats` timings within ~`seconds` each, summed over the GEMMs by count.
    The dtypes are timed in turn for each product, so a competitor that comes and goes slows both alike."""
    flops = sum((6 if training else 2) * g.tokens * g.in_features * g.out_features * g.count for g in gemms)
    total = {dtype: 0.0 for dtype in dtypes}
    for g in gemms:
        backward = ((g.tokens, g.out_features, g.in_features), (g.in_features, g.tokens, g.out_features))
        for m, k, n in ((g.tokens, g.in_features, g.out_features), *(backward if training else ())):
            for dtype in dtypes:
                total[dtype] += g.count * _best_seconds(m, k, n, dtype, seconds, repeats)
    return {dtype: flops / seconds_taken for dtype, seconds_taken in total.items()}


# One timing covers at least this long: a decode step's (1, dim) x (dim, hidden) product takes microseconds, where
# one call's timing is mostly the timer's and the thread pool's wake-up, so such products are timed in batches.
MIN_TIMING_S = 2e-3


def _best_seconds(m: int, k: int, n: int, dtype: torch.dtype, seconds: float, repeats: int) -> float:
    a, b, out = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
    start = time.perf_counter()
    torch.mm(a, b, out=out)  # warm-up: oneDNN's kernel choice and the output's first touch
    calls = max(1, min(10_000, int(MIN_TIMING_S / max(time.perf_counter() - start, 1e-7))))
    best, deadline, done = float("inf"), time.perf_counter() + seconds, 0
    while done < repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        best, done = min(best, (time.perf_counter() - start) / calls), done + 1
    return best


# --- The cache ------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model, part of the cache's key: /proc/cpuinfo's model name with its family, model and
    stepping numbers (virtual machines often show only "AMD EPYC" or "Intel Xeon Processor", the same name
    for generations that differ in peak several-fold), else what `platform` knows."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        first = ""
    info = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    name = info.get("model name") or platform.processor() or platform.machine()
    ids = [f"{key} {info[key]}" for key in ("cpu family", "model", "stepping", "CPU implementer", "CPU part")
           if info.get(key)]  # x86 numbers; ARM's implementer and part (Neoverse V1, V2, ...)
    return f"{name} ({', '.join(ids)})" if ids else name


def machine_key() -> str:
    """What a measured rate depends on besides the shapes: the CPU, torch's thread count, torch itself, and a cap
    on the instructions oneDNN may use (ONEDNN_MAX_CPU_ISA: AVX512_CORE_BF16 on an AMX CPU runs as one without)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return (f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"
            + (f" | isa {isa}" if isa else ""))


def _peak_key(dtype: torch.dtype) -> str:
    return f"{machine_key()} | peak {dtype_name(dtype)}"


def _gemm_key(gemms: list[Gemm], training: bool) -> str:
    return f"{machine_key()} | {'training' if training else 'forward'} gemms {' '.join(g.describe() for g in gemms)}"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def rates_path() -> Path:
    return default_cache_dir() / "hardware" / "cpu-rates.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`: the ranks of a node that start together measure once, one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Measured:
    """One cache entry: FLOP/s by name ("fp32", "bf16"). quiet: no other process took cores from the measurement
    (see `busy_elsewhere`); job: the job that measured (`job_id`), whose other ranks use its figures even when they
    are not quiet."""

    rates: dict[str, float]
    quiet: bool = True
    job: str = ""


def _read(path: Path) -> dict[str, Measured]:
    try:
        raw = json.loads(path.read_text())
        entries = {key: Measured({name: float(v) for name, v in entry["rates"].items()}, bool(entry["quiet"]),
                                 str(entry.get("job", "")))
                   for key, entry in raw.items()}
        # a rate that is no rate (0, negative, NaN, inf: a hand-edited or damaged file) is measured again
        return {key: entry for key, entry in entries.items()
                if entry.rates and all(math.isfinite(rate) and rate > 0 for rate in entry.rates.values())}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}  # missing, damaged or another version's: measured again, never fatal


def _write(path: Path, entries: dict[str, Measured]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in entries.items()}, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one


def cpu_seconds() -> Optional[tuple[float, float]]:
    """(busy CPU-seconds of the cores this process may run on, from /proc/stat; this process's CPU-seconds),
    or None where there is no /proc/stat. Busy includes steal: a hypervisor's other guests compete too."""
    try:
        cpus, busy = usable_cpus(), 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *ticks = line.split()
                if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
                    busy += user + nice + system + irq + softirq + steal
    except (OSError, ValueError, AttributeError):
        return None
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def usable_cpus() -> set[int]:
    return os.sched_getaffinity(0)  # Linux; elsewhere AttributeError, and no contention check


def busy_elsewhere(before: Optional[tuple[float, float]], wall_s: float) -> Optional[float]:
    """How many of this process's cores other processes kept busy since `before` (a mean over `wall_s`), beyond
    the cores torch's threads leave free; None where it cannot be read."""
    after = cpu_seconds()
    if before is None or after is None or wall_s <= 0:
        return None
    others = ((after[0] - before[0]) - (after[1] - before[1])) / wall_s
    spare = len(usable_cpus()) - torch.get_num_threads()
    return max(0.0, others - max(spare, 0))


def job_id() -> str:
    """The ranks of one torchrun job on a node share their launcher (the parent process); a plain run is its own."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return f"{platform.node()}:{os.getppid() if launched else os.getpid()}"


# Other processes may keep this much of a core busy during the measurement (daemons, a shell) and it still
# counts as quiet: the best-of-many timing rides out short interruptions, not a competitor that never stops.
QUIET_CORES = 0.5

_IN_PROCESS: dict[str, Measured] = {}


@dataclass(frozen=True)
class Rates:
    """Measured FLOP/s by name, and where they come from (the header's words)."""

    rates: dict[str, float]
    quiet: bool
    where: str


def cached_rates(key: str, measure: Callable[[], dict[str, float]], expected: tuple[str, ...],
            again: bool = False) -> Rates:
    """The rates kept under `key`, measured (by `measure`) where there are none yet, or where the figures are
    provisional and another job made them, or `again` (a provisional figure that a run has beaten). A new
    measurement keeps, name by name, the higher of it and the previous figure."""
    path = rates_path()
    where = f"cached in {path}"
    entry = _IN_PROCESS.get(key)
    if entry is None or (again and not entry.quiet):
        try:
            with _locked(path):
                entries = _read(path)
                entry = entries.get(key, entry)  # another job may have settled it meanwhile
                if entry is not None and not set(expected) <= set(entry.rates):
                    entry = None  # a figure missing (another version's entry): measured afresh
                if entry is None or not (entry.quiet or (entry.job == job_id() and not again)):
                    entries[key] = entry = _measure(entry, measure)
                    _write(path, entries)
        except OSError as err:  # an unwritable cache (read-only home, full disk): this process's figures only
            entry = _measure(entry, measure) if entry is None or again else entry
            where = f"not cached ({err.strerror or err}: {path})"
        _IN_PROCESS[key] = entry
    if not entry.quiet:
        where = f"measured while other processes were busy: provisional, {where}"
    return Rates(dict(entry.rates), entry.quiet, where)


def _measure(previous: Optional[Measured], measure: Callable[[], dict[str, float]]) -> Measured:
    before, start = cpu_seconds(), time.perf_counter()
    rates = measure()
    elsewhere = busy_elsewhere(before, time.perf_counter() - start)
    quiet = elsewhere is None or elsewhere <= QUIET_CORES
    if previous is not None:
        rates = {name: max(rate, previous.rates.get(name, 0.0)) for name, rate in rates.items()}
    return Measured(rates, quiet, job_id())


def cpu_peak_flops(dtype: torch.dtype = torch.float32, again: bool = False) -> Rates:
    """This machine's n x n matmul peak in `dtype` (rates[dtype_name(dtype)]), for this process's thread count:
    what CPU MFU divides by, one figure for every run and rank of the machine (a peak measured at each start,
    while other threads or processes compete, comes out low and makes MFU exceed 100%). `again`: measure a
    provisional figure once more now."""
    name = dtype_name(dtype)
    return cached_rates(_peak_key(dtype), lambda: {name: measure_cpu_matmul_flops(dtype=dtype)}, (name,), again)


def cpu_gemm_rates(gemms: list[Gemm], training: bool = True) -> Rates:
    """fp32's and bf16's rates ("fp32", "bf16") at `gemms`, a model's matmuls: a training step's, or the forward
    only (generation) (`measure_gemm_rates`)."""
    def measure() -> dict[str, float]:
        rates = measure_gemm_rates(gemms, (torch.float32, torch.bfloat16), training)
        return {dtype_name(dtype): rate for dtype, rate in rates.items()}

    return cached_rates(_gemm_key(gemms, training), measure, ("fp32", "bf16"))


def raise_cached_peak(dtype: torch.dtype, flops: float) -> float:
    """The cached `dtype` peak raised to `flops` (a run's rate beat it), in the cache too; the figure now kept."""
    key, name = _peak_key(dtype), dtype_name(dtype)
    entry = _IN_PROCESS.get(key, Measured({name: flops}))
    entry = replace(entry, rates={name: max(entry.rates.get(name, 0.0), flops)})
    path = rates_path()
    try:
        with _locked(path):
            entries = _read(path)
            if key in entries:
                entry = replace(entry, rates={name: max(entry.rates[name], entries[key].rates.get(name, 0.0))})
            entries[key] = entry
            _write(path, entries)
    except OSError:
        pass  # an unwritable cache: this run still divides by the raised figure
    _IN_PROCESS[key] = entry
    return entry.rates[name]
