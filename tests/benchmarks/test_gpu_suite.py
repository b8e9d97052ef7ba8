"""benchmarks/gpu_suite.py without a GPU: its kernel categoriser on real H100 kernel names, its reading of a CUDA
chrome trace (categories, idle gap, top kernels) on a hand-made one, and its --dry-run, which runs every part at
the debug shape on this CPU and must write each part's file with figures, not errors, where a CPU can measure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
suite = load_benchmark("gpu_suite")

# Names as torch.profiler records them on an H100 (cuBLAS, FlashAttention 2, inductor, the fused AdamW, NCCL).
H100_KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(...)": "gemm",
    "flash_fwd_kernel": "attention",
    "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_poi_fused_mul_silu_1": "elementwise/fused",
    "triton_red_fused__log_softmax_nll_loss_forward_2": "loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::"
    "ADAM_MODE)1, false>, float*, double, float*, float*, float*, float, float, float, float, bool*, float*>":
        "optimizer",
    "ncclDevKernel_AllGather_RING_LL": "communication",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>": "elementwise/fused",
    "Memcpy HtoD (Pageable -> Device)": "other",
}


def test_the_categoriser_maps_real_h100_kernel_names():
    assert {name: suite.category(name) for name in H100_KERNELS} == H100_KERNELS


def test_a_generic_kernel_takes_the_category_of_the_op_around_its_launch():
    exp = "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda, ...>"
    assert suite.refined(exp, ["ember/forward", "_LinearCrossEntropySum", "aten::exp"]) == "loss"
    assert suite.refined(exp, ["ember/optimizer", "aten::mul_"]) == "optimizer"
    assert suite.refined(exp, ["ember/forward"]) == "elementwise/fused"
    # a kernel whose own name says what it is keeps that: the loss's output projection is a GEMM
    assert suite.refined("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", ["_LinearCrossEntropySum"]) == "gemm"


def _event(cat, name, ts, dur, correlation=None, tid=1):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0 if cat in suite.DEVICE_EVENTS else 1,
             "tid": tid}
    return event | ({"args": {"correlation": correlation}} if correlation is not None else {})


def test_a_cuda_trace_reads_as_kernel_time_by_category_idle_gap_and_top_kernels():
    exp = "void at::native::vectorized_elementwise_kernel<4, exp>"
    mul = "void at::native::vectorized_elementwise_kernel<4, mul>"
    adam = "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>"
    events = [
        _event("user_annotation", suite.STEP_RANGE, 0, 1000),
        _event("cpu_op", "_LinearCrossEntropySum", 100, 200),
        _event("cuda_runtime", "cudaLaunchKernel", 150, 5, correlation=7),
        _event("user_annotation", "ember/optimizer", 600, 300),
        _event("cuda_driver", "cuLaunchKernel", 650, 5, correlation=8),
        _event("cuda_runtime", "cudaLaunchKernel", 660, 5, correlation=9),
        _event("kernel", "flash_fwd_kernel", 0, 50, correlation=1, tid=7),
        _event("kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 100, 300, correlation=2, tid=7),
        _event("kernel", exp, 400, 100, correlation=7, tid=7),
        _event("kernel", adam, 700, 100, correlation=8, tid=7),
        _event("kernel", mul, 800, 50, correlation=9, tid=7),
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 950, 100, correlation=3, tid=8),  # past the step
    ]
    found = suite.breakdown(events, cuda=True)
    assert found["profiled_step_ms"] == 1.0
    assert found["busy_ms"] == pytest.approx(0.65) and found["idle_ms"] == pytest.approx(0.35)
    assert {k: round(v, 3) for k, v in found.items() if k.endswith("_ms") and v} == {
        "profiled_step_ms": 1.0, "busy_ms": 0.65, "idle_ms": 0.35, "work_ms": 0.65, "gemm_ms": 0.3,
        "attention_ms": 0.05, "loss_ms": 0.1, "optimizer_ms": 0.15, "other_ms": 0.05}
    assert [(k["name"], k["category"], k["calls"]) for k in found["top"][:3]] == [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm", 1), (exp, "loss", 1), (adam, "optimizer", 1)]


@pytest.mark.slow
def test_the_dry_run_writes_every_part_with_figures(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"gpu_suite-{part}-dryrun-cpu.json" for part in ("fp8", "mfu", "profile", "xla")], files
    parts = {part: json.loads((tmp_path / f"gpu_suite-{part}-dryrun-cpu.json").read_text())
             for part in ("mfu", "profile", "fp8", "xla")}
    for part, result in parts.items():
        assert result["date"] and result["machine"] and result["torch"] and result["dry_run"] is True, part
        assert isinstance(result["elapsed_s"], float) and result["budget_s"] > 0, part
    assert "error" not in parts["mfu"] and "error" not in parts["profile"] and "error" not in parts["fp8"]

    mfu = parts["mfu"]["rows"]
    assert [r["model"] for r in mfu] == ["llama3.2-1b", "llama3.1-8b (4 of 32 layers)"]
    for row in mfu:
        assert "error" not in row and row["tokens_per_s"] > 0 and row["step_time_s"] > 0 and row["mfu"] > 0, row

    profile = parts["profile"]
    for row in profile["rows"]:
        assert "error" not in row, row
        assert row["profiled_step_ms"] > 0 and 0 <= row["idle_share"] < 1 and row["gemm_ms"] > 0, row
        assert row["work_ms"] == pytest.approx(sum(row[f"{c}_ms"] for c in suite.CATEGORIES))
    assert len(profile["top_kernels"]) == 30 and all(k["name"] and k["ms"] > 0 for k in profile["top_kernels"])

    fp8 = {r["fp8_recipe"]: r for r in parts["fp8"]["rows"]}
    assert fp8[""]["tokens_per_s"] > 0 and fp8[""]["source"] == "measured earlier in this run"
    for recipe in ("rowwise", "tensorwise"):
        assert "needs CUDA (sm89+)" in fp8[recipe]["error"]
        assert fp8[f"{recipe} (emulated)"]["ratio_to_bf16"] > 0  # the ratio's plumbing, not a speed

    xla = parts["xla"]
    if "error" in xla and "not installed" in xla["error"]:
        pytest.skip(xla["error"].splitlines()[0])
    assert "error" not in xla, xla.get("error")
    assert [r["path"] for r in xla["rows"]] == ["xla (jax cpu)", "torch device=cpu compile=false"]
    assert xla["rows"][0]["ratio_xla_vs_torch"] == pytest.approx(
        xla["rows"][0]["tokens_per_s"] / xla["rows"][1]["tokens_per_s"])
    table = done.stdout[done.stdout.index("\npart     status"):]
    assert [line.split()[:2] for line in table.splitlines()[2:6]] == [
        ["mfu", "ok"], ["profile", "ok"], ["fp8", "ok"], ["xla", "ok"]], table
