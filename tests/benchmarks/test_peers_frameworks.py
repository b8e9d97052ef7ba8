"""benchmarks/peers_frameworks.py: each framework's command, and the reading of the files its run writes.

ember's metrics.jsonl was captured from a real run of the tiny shape. litgpt's metrics.csv and torchtitan's
metrics.jsonl are laid out as litgpt 0.5.13's pretrain.py logs each iteration through Lightning's CSVLogger and
as torchtitan's MetricsProcessor builds each step's record (read from their sources; the peers' environment is
not installed here), with the figures of real runs' console lines. The runners' own files are written here by
the runners' own code (peers_runners/common.py, which is stdlib only)."""

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import BENCHMARKS, load_benchmark

peers = load_benchmark("peers")
frameworks = peers.frameworks
RUNNER_SCRIPTS = BENCHMARKS / "peers_runners"

# `ember train debug ... logging_steps=1`'s metrics.jsonl: one record per step, then the final validation's.
EMBER_METRICS = """\
{"step": 1, "loss": 6.630095481872559, "loss_avg": 6.630095481872559, "lr": 0.002, "grad_norm": 0.7299246788024902, \
"tokens_per_s": 7874.442506116272, "tokens_per_s_per_device": 7874.442506116272, "step_time_s": 0.016255119000561535, \
"tflops_per_device": 0.00698192169470303, "mfu": 0.05348246533000974, "memory_gb": 0.3253517150878906, \
"tokens_seen": 128, "data_wait_frac": 0.14244608153371519}
{"step": 2, "loss": 6.658548831939697, "loss_avg": 6.658548831939697, "lr": 0.002, "grad_norm": 0.7266488075256348, \
"tokens_per_s": 14443.85026664115, "tokens_per_s_per_device": 14443.85026664115, "step_time_s": 0.00886190299934242, \
"tflops_per_device": 0.012806726502018974, "mfu": 0.09810125866275271, "memory_gb": 0.3268165588378906, \
"tokens_seen": 256, "data_wait_frac": 0.010321823232995181}
{"step": 3, "loss": 6.643980026245117, "loss_avg": 6.643980026245117, "lr": 0.002, "grad_norm": 0.730373203754425, \
"tokens_per_s": 16877.456868083143, "tokens_per_s_per_device": 16877.456868083143, \
"step_time_s": 0.0075840810022782534, "tflops_per_device": 0.014964498396827128, "mfu": 0.11463008347637088, \
"memory_gb": 0.3269386291503906, "tokens_seen": 384, "data_wait_frac": 0.012881191301306431}
{"step": 3, "val_loss": 6.693024635314941}
"""

# litgpt's CSV logger: pretrain.py's per-iteration metrics, `step` overwritten by Fabric's (iteration - 1); a
# column that appears later (a throughput figure once its window fills) leaves the earlier rows' cells empty.
LITGPT_CSV = """\
loss,iter,step,epoch,iter_time,remaining_time,tokens,total_tokens,learning_rate,device/batches_per_sec
6.390,1,0,0,21.29549163,106.47,128,128,0.002,
6.377,2,1,0,1.05810042,44.71,256,256,0.002,
6.476,3,2,0,0.57980117,22.63,384,384,0.002,0.87
"""

# torchtitan's MetricsProcessor record of a step, as the runner's JsonlLogger writes it (log_freq=1).
TITAN_STEP = {"loss_metrics/global_avg_loss": 6.64856, "loss_metrics/global_max_loss": 6.64856, "grad_norm": 0.7329,
              "tflops": 0.0, "time_metrics/data_loading(s)": 0.0004, "time_metrics/data_loading(%)": 0.03,
              "memory/max_active(GiB)": -0.0, "memory/max_reserved(GiB)": -0.0, "memory/num_ooms": 0,
              "n_tokens_seen": 128, "lr": 0.002}
TITAN_PATCH = ("attention: torchtitan's ScaledDotProductAttention (causal) in place of flex in 2 layers (flex has no "
               "backward on a CPU; its Llama 3 configs refuse attn_backend='sdpa')")


def runner_common(out: Path):
    """peers_runners/common.py, fresh (its facts path is module state), its run's output folder `out`."""
    spec = importlib.util.spec_from_file_location("peers_runner_common", RUNNER_SCRIPTS / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    common.parse_args([f"--{flag}=1" for flag in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab", "ffn-hidden",
                                                   "batch", "seq", "steps")] + ["--out", str(out)])
    return common


def test_ember_reads_its_step_times_from_metrics_jsonl_and_its_parameters_from_run_json(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(EMBER_METRICS + '{"step": 4, "loss": 6.6, "step_ti')  # being written
    (tmp_path / "run.json").write_text(json.dumps({"params": 164_160, "family": "llama"}))
    assert frameworks.read_ember(tmp_path) == frameworks.Measured(
        [0.016255119000561535, 0.00886190299934242, 0.0075840810022782534], 164_160, [], [])


def test_litgpt_reads_iter_time_from_its_csv_logger_and_its_facts_from_the_runner(tmp_path, capsys):
    logs = tmp_path / "logs" / "csv" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text(LITGPT_CSV + "6.41,4,3,0,0.571")  # a row still being written
    common = runner_common(tmp_path)
    common.say("version", "litgpt 0.5.13")
    common.say("params", 164_160)
    assert capsys.readouterr().out == "PEERS version litgpt 0.5.13\nPEERS params 164160\n"
    assert frameworks.read_litgpt(tmp_path) == frameworks.Measured([21.29549163, 1.05810042, 0.57980117], 164_160,
                                                                    [], ["litgpt 0.5.13"])


def test_torchtitan_reads_end_to_end_seconds_and_each_patch_once(tmp_path):
    common = runner_common(tmp_path)
    for patch in ("device cpu: ...", TITAN_PATCH, TITAN_PATCH):  # said again for another layer count
        common.say("patch", patch)
    common.say("version", "torchtitan 0.3.0")
    common.say("argv", "--module peers_torchtitan_config --config peers_llama3")
    common.say("params", 164_160)
    # the console printed tps 87 and 101 for these steps: the record has them, and the step's seconds, in full
    for step, tps, seconds in [(1, 87.04, 1.47059), (2, 101.31, 1.26345)]:
        common.append_jsonl(tmp_path / "metrics.jsonl",
                            {"step": step, **TITAN_STEP, "throughput(tps)": tps, "time_metrics/end_to_end(s)": seconds})
    assert frameworks.read_torchtitan(tmp_path) == frameworks.Measured([1.47059, 1.26345], 164_160,
                                                                       ["device cpu: ...", TITAN_PATCH],
                                                                       ["torchtitan 0.3.0"])


def test_steps_are_read_in_step_order_each_once():
    records = [{"step": 3, "t": 0.3}, {"step": 1, "t": 0.1}, {"step": 2, "t": 0.2}, {"step": 2, "t": 0.25},
               {"step": 3, "val_loss": 6.7}, {"step": "4", "t": "0.4"}, {"step": 5, "t": ""}]
    assert frameworks.steps_in_order(records, "step", "t") == [0.1, 0.25, 0.3, 0.4]


def test_a_run_that_wrote_nothing_yet_reads_as_no_steps_and_no_facts(tmp_path):
    empty = frameworks.Measured([], None, [], [])
    assert frameworks.read_ember(tmp_path) == empty
    assert frameworks.read_litgpt(tmp_path) == empty
    assert frameworks.read_torchtitan(tmp_path) == empty
    assert peers.steps_logged(peers.RUNNERS["torchtitan"], tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time_metrics/end_to_end(s)": 1.5}\n{"step": 2}\nnot json\n')
    assert peers.steps_logged(peers.RUNNERS["torchtitan"], tmp_path) == 0  # caught mid-rewrite: none yet


def test_a_runners_facts_keep_values_json_has_no_type_for(tmp_path):
    common = runner_common(tmp_path)
    common.append_jsonl(tmp_path / "m.jsonl", {"step": 1, "loss": torch.tensor(0.5), "where": Path("/x")})
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 1, "loss": 0.5, "where": "/x"}
    spec = importlib.util.spec_from_file_location("peers_runner_common_unset", RUNNER_SCRIPTS / "common.py")
    unset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unset)
    with pytest.raises(RuntimeError, match="say\\(\\) before parse_args\\(\\)"):
        unset.say("params", 1)


def _constant(script: str, name: str) -> str:
    """A module-level string constant of a runner script, read without running it (it imports its framework)."""
    tree = ast.parse((RUNNER_SCRIPTS / script).read_text())
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))


def test_the_runners_write_the_files_peers_py_reads():
    assert _constant("common.py", "FACTS_FILE") == frameworks.FACTS_FILE == "peers.jsonl"
    assert _constant("torchtitan_run.py", "METRICS_FILE") == frameworks.TITAN_METRICS_FILE == "metrics.jsonl"
    # the key read is the one torchtitan's MetricsProcessor.log names, and litgpt logs through its CSV logger
    assert frameworks.TITAN_STEP_TIME == "time_metrics/end_to_end(s)"
    assert 'logger_name="csv"' in (RUNNER_SCRIPTS / "litgpt_run.py").read_text()


def test_the_peers_are_given_embers_ffn_width_and_recipe_settings():
    job = frameworks.Job(peers.SHAPES["debug"], "bf16", "compiled", 15, "cpu", Path("/out"), Path("/py"))
    cmd = peers.RUNNERS["torchtitan"].command(job)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert cmd[:2] == ["/py", str(RUNNER_SCRIPTS / "torchtitan_run.py")]
    assert (flag("--dim"), flag("--vocab"), flag("--ffn-hidden"), flag("--rope-theta"), flag("--norm-eps")) == (
        "256", "8192", "704", "500000.0", "1e-05")
    assert (flag("--lr"), flag("--weight-decay"), flag("--eps"), flag("--max-norm")) == ("0.002", "0.1", "1e-08", "1.0")
    assert cmd[cmd.index("--betas") + 1:cmd.index("--betas") + 3] == ["0.9", "0.95"]
    assert (flag("--precision"), flag("--mode"), flag("--steps"), flag("--out")) == ("bf16", "compiled", "15", "/out")
    assert peers.RUNNERS["litgpt"].command(job)[1] == str(RUNNER_SCRIPTS / "litgpt_run.py")


def test_ember_trains_the_same_shape_through_its_own_cli():
    job = frameworks.Job(peers.SHAPES["56m"], "fp32", "compiled", 10, "cpu", Path("/out"))
    cmd = peers.RUNNERS["ember"].command(job)
    assert cmd[1:5] == ["-m", "ember", "train", "debug"]
    assert {"model.dim=512", "model.n_layers=8", "model.n_kv_heads=4", "model.vocab_size=32000", "seq_len=512",
            "global_batch_size=8", "micro_batch_size=8", "max_steps=10", "logging_steps=1", "compile=True",
            "precision=fp32", "output_dir=/out", "eval_interval=0", "checkpoint.interval=0"} <= set(cmd)


def test_the_debug_shape_is_embers_debug_flavor_at_the_debug_recipes_batch():
    llama, recipe = frameworks.model_args(peers.SHAPES["debug"]), peers.frameworks.load_config("debug", [])
    flavor = frameworks.FLAVORS["llama3"]["debug"]
    assert (llama.dim, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.vocab_size, llama.ffn_hidden_dim) == (
        flavor.dim, flavor.n_layers, flavor.n_heads, flavor.n_kv_heads, flavor.vocab_size, 704)
    assert (peers.SHAPES["debug"].batch, peers.SHAPES["debug"].seq) == (recipe.global_batch_size, recipe.seq_len)


def test_litgpt_has_no_eager_run_and_each_peer_is_held_against_in_its_default_mode():
    assert {name: runner.no_run for name, runner in peers.RUNNERS.items()} == {
        "ember": {}, "litgpt": {"eager": "n/a (litgpt pretrain always compiles)"}, "torchtitan": {}}
    assert peers.table.DEFAULT_MODE == {"litgpt": "compiled", "torchtitan": "eager"}
    assert peers.FRAMEWORKS == ("ember", "litgpt", "torchtitan")
    assert peers.NOTES == ("step times are each framework's own: ember's step_time_s (data wait included), litgpt's "
                           "iter_time (no data fetch), torchtitan's end_to_end(s) (all of a step); litgpt's "
                           "pretraining always compiles")
