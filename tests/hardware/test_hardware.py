"""Device-name matching, the dense-peak table, the unknown-device and override paths, the CPU measurement."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ember.errors import ConfigError
from ember.hardware import cpu_rates, device, peaks as hardware
from ember.hardware.peaks import match_device, peak_flops


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
        ("NVIDIA GH200 480GB", "NVIDIA GH200"),  # contains "H200" but is not one
        ("NVIDIA B200", "NVIDIA B200"),
        ("NVIDIA GB200", "NVIDIA GB200"),  # contains "B200"
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB"),
        ("AMD Instinct MI250X", "AMD Instinct MI250X (one GCD)"),
        ("AMD Instinct MI300X", "AMD Instinct MI300X"),
        ("AMD Instinct MI300X VF", "AMD Instinct MI300X"),
        ("AMD Instinct MI325X", "AMD Instinct MI325X"),
        ("AMD Instinct MI355X", "AMD Instinct MI355X"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_match_device(name, expected):
    spec = match_device(name)
    assert (spec.name if spec else None) == expected


def _specs():
    return [value for value in vars(hardware).values() if isinstance(value, hardware.DeviceSpec)]


def test_table_holds_dense_rates():
    # Dense rates keep the tensor-core ratios: fp8 = 2 x bf16 and tf32 = bf16 / 2 wherever they exist.
    # A "with sparsity" figure copied into one column (and not the other) breaks a ratio.
    assert len(_specs()) >= 17
    for spec in _specs():
        assert spec.bf16 is not None and spec.memory_gb > 0, spec.name
        if spec.fp8 is not None:
            assert spec.fp8 == pytest.approx(2 * spec.bf16, rel=1e-3), spec.name
        if spec.tf32 is not None:
            assert spec.tf32 == pytest.approx(spec.bf16 / 2, rel=1e-3), spec.name
    assert hardware.H100_SXM.bf16 == 989.4e12 and hardware.A100_80GB.bf16 == 312e12
    assert hardware.MI300X.bf16 == 1307.4e12 and hardware.TPU_V5E.bf16 == 197e12


@pytest.fixture
def cuda_named(monkeypatch):
    """Pretend a CUDA device of the given name: peak_flops reads only its name."""

    def set_name(name):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return set_name


def test_peak_flops_h100_per_dtype(cuda_named, monkeypatch):
    cuda_named("NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    peak = peak_flops(cuda, torch.bfloat16, None)
    assert peak.value_flops == 989.4e12
    assert "H100 SXM" in peak.source and "datasheet" in peak.source
    assert peak_flops(cuda, torch.float8_e4m3fn, None).value_flops == 1978.9e12
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: False)
    assert peak_flops(cuda, torch.float32, None).value_flops == 66.9e12
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: True)
    assert peak_flops(cuda, torch.float32, None).value_flops == 494.7e12


def test_tf32_allowed_on_a_device_without_tf32_uses_fp32(cuda_named, monkeypatch):
    cuda_named("AMD Instinct MI250X")
    monkeypatch.setattr(hardware, "_tf32_allowed", lambda: True)
    assert peak_flops(torch.device("cuda"), torch.float32, None).value_flops == 47.85e12


def test_tf32_flag_read_without_error():
    assert isinstance(hardware._tf32_allowed(), bool)


def test_unknown_device_has_no_peak(cuda_named):
    cuda_named("NVIDIA GeForce RTX 4090")
    peak = peak_flops(torch.device("cuda"), torch.bfloat16, None)
    assert peak.value_flops is None
    assert peak.source == "unknown device 'NVIDIA GeForce RTX 4090': set metrics.peak_tflops"


def test_missing_precision_has_no_peak(cuda_named):
    cuda_named("NVIDIA A100-SXM4-80GB")  # no fp8 on Ampere
    peak = peak_flops(torch.device("cuda"), torch.float8_e4m3fn, None)
    assert peak.value_flops is None and "metrics.peak_tflops" in peak.source


def test_user_peak_overrides_everything(cuda_named, monkeypatch):
    cuda_named("NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda"), torch.bfloat16, 800.0) == hardware.PeakFlops(800e12, "metrics.peak_tflops")

    def no_measuring(*args, **kwargs):
        raise AssertionError("the CPU must not be measured when the user gives a peak")

    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", no_measuring)
    assert peak_flops(torch.device("cpu"), torch.float32, 0.5).value_flops == 0.5e12


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 0.0)  # a quiet machine
    return tmp_path / "hardware" / "cpu-rates.json"


def _cached(path: Path) -> dict:
    return json.loads(path.read_text())


def test_cpu_peak_is_measured_once_per_machine_and_cached(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: calls.append(1) or 1.5e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert peak.value_flops == 1.5e11 and peak.measured and calls == [1]
    assert peak.source.startswith("measured CPU fp32 matmul") and f"cached in {fresh_cache}" in peak.source
    key = f"{cpu_rates.cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__} | peak fp32"
    (entry,) = _cached(fresh_cache).values()
    assert list(_cached(fresh_cache)) == [key]  # keyed by the CPU model, threads, torch
    assert entry["rates"] == {"fp32": 1.5e11} and entry["quiet"] is True
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})  # a new process: reads the file, measures nothing
    assert peak_flops(torch.device("cpu"), torch.float32, None).value_flops == 1.5e11 and calls == [1]


def test_the_key_names_the_cpu_model(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    # Two machines sharing one home directory (an NFS cache) keep one figure each.
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 1e11)
    monkeypatch.setattr(cpu_rates, "cpu_model", lambda: "CPU A")
    cpu_rates.cpu_peak_flops()
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "cpu_model", lambda: "CPU B")
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 3e11)
    assert cpu_rates.cpu_peak_flops().rates["fp32"] == 3e11
    assert sorted(k.split(" | ")[0] for k in _cached(fresh_cache)) == ["CPU A", "CPU B"]


def test_cpu_model_carries_the_family_numbers():
    # VMs often name only "AMD EPYC": the family/model numbers of /proc/cpuinfo tell generations apart.
    name = cpu_rates.cpu_model()
    assert name
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "cpu family" in cpuinfo.read_text():
        assert "cpu family" in name and "model" in name


def test_a_damaged_cache_is_measured_again(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 2e11)
    fresh_cache.parent.mkdir(parents=True)
    for damaged in ("{not json", "[1, 2]", '{"k": {"no flops": 1}}', '{"k": "fast"}'):
        fresh_cache.write_text(damaged)
        monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
        assert cpu_rates.cpu_peak_flops().rates["fp32"] == 2e11
        assert [e["rates"] for e in _cached(fresh_cache).values()] == [{"fp32": 2e11}]


def test_a_measurement_under_load_is_provisional(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    # Other processes kept cores busy while it measured: this job uses the figure; the next job measures again
    # and keeps the higher one; a quiet measurement settles it and nothing measures after that.
    rates, busy, job = iter([1e11, 2.5e11, 2e11]), iter([1.5, 0.0]), ["job-1"]
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: next(rates))
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: next(busy))
    monkeypatch.setattr(cpu_rates, "job_id", lambda: job[0])
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert peak.value_flops == 1e11 and "provisional" in peak.source
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})  # another rank of the same job: the same figure
    assert cpu_rates.cpu_peak_flops().rates["fp32"] == 1e11
    job[0] = "job-2"
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})  # the next job: measured again, quietly
    measured = cpu_rates.cpu_peak_flops()
    assert measured.rates["fp32"] == 2.5e11 and "provisional" not in measured.where
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    job[0] = "job-3"
    assert cpu_rates.cpu_peak_flops().rates["fp32"] == 2.5e11  # settled: the third rate is never measured
    (entry,) = _cached(fresh_cache).values()
    assert entry["rates"] == {"fp32": 2.5e11} and entry["quiet"] is True


def test_an_unwritable_cache_measures_without_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "file"))  # a file where the directory should be
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "busy_elsewhere", lambda before, wall_s: 0.0)
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 1e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert peak.value_flops == 1e11 and "not cached" in peak.source


@pytest.mark.slow
def test_ranks_starting_together_measure_once(tmp_path: Path):
    # Three processes at once, as torchrun starts a node's ranks (LOCAL_RANK set, one parent): the file lock
    # lets one measure while the others wait, then read its number, even though the others' start-up kept the
    # cores busy while it measured (a provisional figure is still the job's one figure). The measuring process
    # holds the lock until every rank has said it is about to ask for the peak (a marker file each), so the
    # others meet the lock however slowly this machine starts them; the ceiling only bounds a hang.
    counter = tmp_path / "measured"
    code = ("import os, pathlib, time, ember.hardware.cpu_rates as h\n"
            f"here = pathlib.Path({str(tmp_path)!r})\n"
            "def slow(dtype=None):\n"
            "    (here / 'measured').open('a').write('x')\n"
            "    deadline = time.monotonic() + 300\n"
            "    while len(list(here.glob('ready-*'))) < 3 and time.monotonic() < deadline:\n"
            "        time.sleep(0.01)\n"
            "    return 3e11\n"
            "h.measure_cpu_matmul_flops = slow\n"
            "(here / f\"ready-{os.environ['LOCAL_RANK']}\").touch()\n"
            "print(h.cpu_peak_flops().rates['fp32'])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "EMBER_CACHE": str(tmp_path), "LOCAL_RANK": str(rank)})
             for rank in range(3)]
    outputs = [p.communicate(timeout=600)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["300000000000.0"] * 3 and counter.read_text() == "x"


def test_a_measured_peak_that_a_run_beats_is_raised(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 1e11)
    peak = peak_flops(torch.device("cpu"), torch.float32, None)
    assert hardware.raise_measured_peak(peak, 0.9e11) is peak  # slower than the peak: unchanged
    raised = hardware.raise_measured_peak(peak, 1.2e11)
    assert raised.value_flops == 1.2e11 and "raised to a training run's rate" in raised.source
    assert [e["rates"] for e in _cached(fresh_cache).values()] == [{"fp32": 1.2e11}]  # the next run starts from it
    given = hardware.PeakFlops(1e11, "metrics.peak_tflops")
    assert hardware.raise_measured_peak(given, 5e11) is given  # the user's number is the user's


def _cpu_seconds_of(pid: int) -> float:
    """A process's user + system CPU-seconds, from /proc/<pid>/stat (fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc/stat: the contention check is Linux-only")
def test_a_busy_competitor_is_seen(monkeypatch: pytest.MonkeyPatch):
    # One process spinning on this process's cores, with torch's threads on every usable core (none spare):
    # every CPU-second it spends inside the window is counted as busy elsewhere, however loaded the machine is.
    monkeypatch.setattr(torch, "get_num_threads", lambda: len(cpu_rates.usable_cpus()))
    spin = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout.readline() == "spinning\n"
        before, start, spun_before = cpu_rates.cpu_seconds(), time.perf_counter(), _cpu_seconds_of(spin.pid)
        deadline = time.monotonic() + 300  # bounds a hang only: the window ends when it has spun half a second
        while _cpu_seconds_of(spin.pid) - spun_before < 0.5:
            assert time.monotonic() < deadline, "the competitor never ran"
            time.sleep(0.01)
        wall_s = time.perf_counter() - start
        spun = _cpu_seconds_of(spin.pid) - spun_before
        # cores x seconds seen busy elsewhere cover the competitor's CPU-seconds, less the kernel's tick sampling
        # (/proc/stat counts ticks, /proc/<pid>/stat the exact run time): a check that missed it would see ~0
        assert cpu_rates.busy_elsewhere(before, wall_s) * wall_s >= 0.8 * spun, (wall_s, spun)
    finally:
        spin.kill()
        spin.wait()


def test_real_cpu_measurement_is_plausible():
    rate = cpu_rates.measure_cpu_matmul_flops(seconds=0.05, sizes=(256,))
    assert 1e9 < rate < 1e15  # above a GFLOP/s, below any CPU that exists


def test_device_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        hardware.H100_SXM.bf16 = 1.0


def test_ember_cpu_bf16_overrides_the_detection(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True}, raising=False)
    for value, expected in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("EMBER_CPU_BF16", value)
        assert device.cpu_runs_bf16_natively() is expected
    monkeypatch.setenv("EMBER_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match="EMBER_CPU_BF16='yes': use 1"):
        device.cpu_runs_bf16_natively()


def test_cpu_bf16_detection_reads_torchs_capabilities(monkeypatch):
    monkeypatch.delenv("EMBER_CPU_BF16", raising=False)
    for flags, expected in (({"avx512_bf16": True}, True), ({"amx_bf16": True, "avx512_bf16": False}, True),
                            ({"avx512_bf16": False, "avx2": True}, False), ({}, False)):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda flags=flags: flags, raising=False)
        assert device.cpu_runs_bf16_natively() is expected, flags


def test_a_bf16_cpu_peak_is_its_own_entry_and_raising_it_leaves_fp32_alone(fresh_cache: Path, monkeypatch):
    """A bf16 run (LoRA's frozen base) beating the fp32 peak must not raise the fp32 figure that full
    training's MFU divides by: each dtype is measured, cached and raised under its own key."""
    monkeypatch.setattr(hardware, "cpu_runs_bf16_natively", lambda: True)
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops",
                        lambda dtype=torch.float32: 4e11 if dtype == torch.bfloat16 else 1e11)
    fp32 = peak_flops(torch.device("cpu"), torch.float32, None)
    bf16 = peak_flops(torch.device("cpu"), torch.bfloat16, None)
    assert (fp32.value_flops, bf16.value_flops) == (1e11, 4e11)
    assert "bf16 matmul" in bf16.source and "fp32 matmul" in fp32.source
    hardware.raise_measured_peak(bf16, 5e11)
    flops = {key.rsplit("| ", 1)[-1]: entry["rates"] for key, entry in _cached(fresh_cache).items()}
    assert flops == {"peak fp32": {"fp32": 1e11}, "peak bf16": {"bf16": 5e11}}
    # Without bf16 instructions a bf16 run's MFU is against the fp32 peak (an emulated bf16 rate means nothing).
    monkeypatch.setattr(hardware, "cpu_runs_bf16_natively", lambda: False)
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    assert peak_flops(torch.device("cpu"), torch.bfloat16, None).value_flops == 1e11


def test_the_measured_peak_counts_its_threads_in_words(monkeypatch):
    monkeypatch.setattr(cpu_rates, "cpu_peak_flops",
                        lambda dtype: cpu_rates.Rates({"fp32": 1e11}, True, "measured now"))
    for threads, words in ((1, "1 thread,"), (4, "4 threads,")):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        assert (f"fp32 matmul, {words} measured now"
                in hardware.peak_flops(torch.device("cpu"), torch.float32, None).source)
