"""benchmarks/xla_trace.py: a jax.profiler trace summed by XLA op kind per device and step, over the train steps
found from the devices' program runs; containers and waits not counted; the time no device ran an op."""

import gzip
import json

import pytest

from tests.helpers import load_benchmark

trace_lib = load_benchmark("xla_trace")


def _event(name: str, ts: float, dur: float, tid: int) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _write_trace(path, events):
    threads = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
               for tid, name in [(1, "tf_XLAEigen/1"), (2, "tf_XLAEigen/2"), (9, "python")]]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": threads + events}, f)


def test_ops_are_summed_by_kind_per_device_and_step_over_the_steps_runs(tmp_path):
    run = "ThunkExecutor::Execute (wait for completion)"
    events = []
    # a short program beside the steps (an lr schedule): not a step, its op not counted
    events += [_event(run, 0, 100, 1), _event("fusion.9", 10, 50, 1)]
    for step, start in enumerate([1_000, 3_000]):  # two steps of 1,500 us on two devices (threads 1, 2)
        for tid in (1, 2):
            events.append(_event(run, start, 1_500, tid))
            events.append(_event("ThunkExecutor::Execute", start, 1_500, tid))  # a container
            events.append(_event(f"ynn_fusion.{step}", start, 600, tid))
            events.append(_event("all-gather.3", start + 600, 300, tid))
            events.append(_event("Rendezvous", start + 600, 250, tid))  # inside the all-gather
            events.append(_event("copy_bitcast_fusion.2", start + 900, 100, tid))
            events.append(_event("add_multiply_fusion", start + 1_000, 100, tid))
        # 1,100-1,500 us of each step: no op on either device
    events.append(_event("ynn_fusion.7", 1_200, 900, 9))  # a python thread's event: not a device's
    path = tmp_path / "vm.trace.json.gz"
    _write_trace(path, events)
    summary = trace_lib.summarize(path, devices=2, steps=2)
    assert summary == {"all-gather": 0.3, "copy/transpose": 0.1, "matmul": 0.6, "other": 0.1, "ops": 1.1,
                       "step": 1.5, "idle": 0.4}
    assert trace_lib.summarize(path, devices=2, steps=1)["step"] == 1.5
    with pytest.raises(ValueError, match="holds 2 runs of the train program, not 3"):
        trace_lib.summarize(path, devices=2, steps=3)


@pytest.mark.parametrize("name, kind", [("ynn_fusion.12", "matmul"), ("dot.3", "matmul"),
                                        ("all-reduce.120", "all-reduce"), ("all-to-all", "all-to-all"),
                                        ("copy", "copy/transpose"),
                                        ("transpose_copy_fusion", "copy/transpose"), ("multiply_add_fusion", "other"),
                                        ("Rendezvous", None), ("Wait: pending_threads=2/", None), ("while.3", None),
                                        ("$python.py:12 f", None)])
def test_op_kinds(name, kind):
    assert trace_lib.op_kind(name) == kind


def test_a_folder_with_no_trace_or_two_is_one_error(tmp_path):
    with pytest.raises(ValueError, match="holds 0 jax.profiler traces, not 1"):
        trace_lib.find_trace(tmp_path)
