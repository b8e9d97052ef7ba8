"""benchmarks/maxtext_peer.py: both trainers are handed the same model, batch, optimizer and layout; MaxText's step
lines and ember's windows are read into step times that keep the same steps; a missing MaxText environment is one
line naming its setup; and the script runs end to end (ember's real XLA side, a stand-in for MaxText's process)."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

peer = load_benchmark("maxtext_peer")
commands = load_benchmark("maxtext_commands")

# a line MaxText 0.2.5 logged on this CPU
MAXTEXT_LINE = ("I1128 23:02:15.350356 140000160213888 metric_logger.py:265] completed step: 1, seconds: 0.878, "
                "TFLOP/s/device: 0.074, Tokens/s/device: 2333.395, total_weights: 2048, loss: 9.472, lm_loss: 9.472, "
                "perplexity: 12995.306")


def _keys(command: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in command if "=" in item and not item.startswith("-"))


@pytest.mark.parametrize("shape_name", list(peer.SHAPES))
@pytest.mark.parametrize("layout", list(peer.LAYOUTS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_both_sides_are_handed_the_same_model_batch_optimizer_and_layout(shape_name, layout, precision, tmp_path):
    shape = peer.SHAPES[shape_name]
    devices, fsdp, tensor = peer.LAYOUTS[layout]
    ember = _keys(peer.ember_command(shape, layout, precision, 1, tmp_path))
    maxtext = _keys(peer.maxtext_command(Path("python"), shape, layout, precision, tmp_path))
    pairs = {"model.dim": "base_emb_dim", "model.n_layers": "base_num_decoder_layers",
             "model.n_heads": "base_num_query_heads", "model.n_kv_heads": "base_num_kv_heads",
             "model.ffn_hidden_dim": "base_mlp_dim", "model.vocab_size": "vocab_size", "seq_len": "max_target_length",
             "max_steps": "steps", "ici_mesh.fsdp": "ici_fsdp_parallelism", "ici_mesh.tensor": "ici_tensor_parallelism",
             "optim.eps": "adam_eps", "optim.weight_decay": "adam_weight_decay",
             "optim.max_grad_norm": "gradient_clipping_threshold"}
    for ember_key, maxtext_key in pairs.items():
        assert float(ember[ember_key]) == float(maxtext[maxtext_key]), (ember_key, maxtext_key)
    assert ember["optim.betas"] == f"[{maxtext['adam_b1']},{maxtext['adam_b2']}]"
    assert int(maxtext["head_dim"]) * shape.n_heads == shape.dim
    # the same global batch: MaxText's per device x devices; ember's micro-batch x its data-parallel ranks
    assert float(maxtext["per_device_batch_size"]) * devices == shape.batch == int(ember["global_batch_size"])
    assert int(ember["micro_batch_size"]) * (devices // tensor) == shape.batch and fsdp * tensor == devices
    assert (ember["model.scan_layers"], ember["model.remat"]) == ("true", "full")
    assert (maxtext["scan_layers"], maxtext["remat_policy"]) == ("true", "full")
    assert (ember["precision"], maxtext["dtype"], maxtext["weight_dtype"]) == (
        precision, {"fp32": "float32", "bf16": "bfloat16"}[precision], "float32")
    assert float(maxtext["rope_max_timescale"]) == commands.ROPE_THETA == 500000.0


def test_maxtext_lines_and_ember_windows_keep_the_same_steps():
    log = "\n".join(MAXTEXT_LINE.replace("step: 1, seconds: 0.878", f"step: {i}, seconds: {s}")
                    for i, s in enumerate([9.0, 2.5, 1.0, 1.2, 1.1]))
    steps = peer.maxtext_steps(log)
    assert [(s, sec) for s, sec, _ in steps] == [(0, 9.0), (1, 2.5), (2, 1.0), (3, 1.2), (4, 1.1)]
    assert steps[0][2] == 9.472
    records = [{"step": i + 1, "tokens_per_s": 2048 / s, "loss": 9.0} for i, s in enumerate([8.0, 2.0, 0.5, 0.6, 0.7])]
    records.insert(2, {"step": 2, "eval_loss": 3.0})  # not a window
    ember = peer.ember_steps(records, 2048)
    assert [s for s, _, _ in ember] == [1, 2, 3, 4, 5]
    warmup = 2
    # the third step onward on both sides: MaxText counts from 0, ember's windows end at their step from 1
    assert peer.steady_seconds(steps, warmup - 1) == [1.0, 1.2, 1.1]
    assert peer.steady_seconds(ember, warmup) == pytest.approx([0.5, 0.6, 0.7])


def test_a_missing_maxtext_environment_names_its_setup(tmp_path):
    with pytest.raises(SystemExit, match=r"no MaxText environment: .*\.venv-maxtext/bin/python does not exist; "
                                         r"set one up with `python3.12 -m venv \.venv-maxtext"):
        peer.find_maxtext_python(None, {}, repo=tmp_path)
    with pytest.raises(SystemExit, match=f"EMBER_MAXTEXT_PYTHON={tmp_path} is not an executable file"):
        peer.find_maxtext_python(None, {"EMBER_MAXTEXT_PYTHON": str(tmp_path)})
    assert peer.find_maxtext_python(None, {"EMBER_MAXTEXT_PYTHON": sys.executable}) == Path(sys.executable)


@pytest.mark.parametrize("argv, message", [
    (["--layout", "fsdp8,fsdp2"], "--layout fsdp8,fsdp2: unknown fsdp2; choose from 1, fsdp8"),
    (["--shape", "8b"], "--shape 8b: unknown 8b; choose from debug, 100m"),
    (["--steps", "4"], "--steps 4 keeps 2 step(s) after --warmup 2; give --steps of at least 5"),
    (["--shape", "100m", "--warmup", "4"], "--steps 6 keeps 2 step(s) after --warmup 4; give --steps of at least 7"),
    (["--tag", "../x"], "--tag ../x: up to 64 lowercase letters and digits, words joined by dots or dashes"),
    (["--tag", "a.."], "--tag a..: up to 64 lowercase letters"),
    (["--steps", "0"], "--steps 0: give a positive number of steps a run")])
def test_wrong_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        peer.main(argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_an_ember_python_without_the_tpu_extra_is_refused_before_any_run(tmp_path):
    bare = tmp_path / "python"
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(bare.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SystemExit, match=f"--ember-python {bare} has no ember, jax, torchax or torch: install "
                       "ember's tpu extra there"):
        peer.main(["--ember-python", str(bare), "--maxtext-python", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match=f"--ember-python {tmp_path} is not an executable file"):
        peer.main(["--ember-python", str(tmp_path), "--maxtext-python", str(tmp_path / "none")])


def test_an_unwritable_results_folder_is_refused_before_any_run(tmp_path):
    (tmp_path / "a-file").write_text("")
    fake = tmp_path / "python"
    fake.write_text(FAKE_MAXTEXT.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SystemExit, match="--out .*a-file: cannot write maxtext_peer-cpu.json there"):
        peer.main(["--maxtext-python", str(fake), "--out", str(tmp_path / "a-file")])


FAKE_MAXTEXT = """#!{python}
# MaxText's process as benchmarks/maxtext_peer.py sees it: the probes it runs with -c, and a training run's lines.
import sys
if sys.argv[1] == "-c":
    print("/fake/maxtext/configs/base.yml" if "base.yml" in sys.argv[2] else "3.12.1\\n0.2.5\\n0.12.0.1\\n0.12.0.1")
    sys.exit(0)
args = dict(a.split("=", 1) for a in sys.argv[4:])
assert sys.argv[2:4] == ["maxtext.trainers.pre_train.train", "/fake/maxtext/configs/base.yml"], sys.argv
for step in range(int(args["steps"])):
    print(f"completed step: {{step}}, seconds: {{2.0 if step else 30.0}}, TFLOP/s/device: 0.1, loss: 9.0, lm_loss: 9.0")
"""


@pytest.mark.slow
def test_the_script_runs_end_to_end_and_writes_its_results(tmp_path, capsys):
    fake = tmp_path / "python"
    fake.write_text(FAKE_MAXTEXT.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    flags = os.environ.get("XLA_FLAGS")
    assert peer.main(["--layout", "fsdp4-tensor2", "--rounds", "1", "--steps", "5", "--maxtext-python", str(fake),
                      "--out", str(tmp_path / "results")]) == 0
    result = json.loads((tmp_path / "results" / "maxtext_peer-cpu.json").read_text())
    (row,) = result["rows"]
    assert (row["shape"], row["precision"], row["layout"]) == ("debug", "fp32", "fsdp4-tensor2")
    assert row["maxtext_step_s"] == 2.0 and row["ratio"] == pytest.approx(2.0 / row["ember_step_s"])
    assert row["maxtext_kept_step_s"] == [[2.0, 2.0, 2.0]] and len(row["ember_kept_step_s"][0]) == 3
    assert row["ember_tokens_per_s"] == pytest.approx(8 * 256 / row["ember_step_s"])
    assert row["plan_error"] == pytest.approx(row["ember_planned_step_s"] / row["ember_step_s"] - 1)
    assert 8.5 < row["ember_first_loss"] < 9.6  # ln(8192) = 9.01: random tokens on a fresh model
    assert (result["maxtext"], result["maxtext_jax"], result["maxtext_python_version"]) == ("0.2.5", "0.12.0.1",
                                                                                           "3.12.1")
    assert (row["ember_python"], row["ember_jax"]) == ("python", result["ember_jax"])  # each row says its ember
    assert "ici_mesh.fsdp=4 ici_mesh.tensor=2" in row["ember_command"]
    assert "fsdp4-tensor2" in capsys.readouterr().out
    assert os.environ.get("XLA_FLAGS") == flags  # the devices are the children's, not this process's
    # --replan prices the stored rows again with this checkout's planner, their measurements kept
    stored = tmp_path / "results" / "maxtext_peer-cpu.json"
    stale = result | {"rows": [row | {"ember_planned_step_s": 123.0, "plan_error": 0.0}]}
    stored.write_text(json.dumps(stale))
    assert peer.main(["--replan", "--out", str(tmp_path / "results")]) == 0
    again = json.loads((tmp_path / "results" / "maxtext_peer-cpu.json").read_text())
    (replanned,) = again["rows"]
    assert replanned["ember_step_s"] == row["ember_step_s"] and again["replanned"] == again["date"]
    assert replanned["ember_planned_step_s"] != 123.0
    assert replanned["plan_error"] == pytest.approx(replanned["ember_planned_step_s"] / row["ember_step_s"] - 1)
    assert sum(replanned["ember_planned_parts_s"].values()) == pytest.approx(replanned["ember_planned_step_s"])


def test_replan_refuses_figures_of_another_machine_or_none(tmp_path):
    import argparse

    with pytest.raises(SystemExit, match="--replan: there is no .*maxtext_peer-cpu.json: measure its rows first"):
        peer.main(["--replan", "--out", str(tmp_path)])
    ember = peer.ember_versions(None, sys.executable)[2]
    args = argparse.Namespace(merge=False, out=tmp_path, maxtext_python=Path(sys.executable), shape="debug",
                              layout="1", precision="fp32", rounds=1, steps=None, warmup=2, profile=False,
                              ember_python=sys.executable, ember_python_shown="python", tag="", ember=ember)
    path = peer.write_results([{"shape": "debug", "precision": "fp32", "layout": "1", "steps": 20,
                                "ember_step_s": 1.0}], args)
    path.write_text(path.read_text().replace('"machine": "', '"machine": "another CPU, '))
    with pytest.raises(SystemExit, match="holds no rows measured on this machine"):
        peer.main(["--replan", "--out", str(tmp_path)])
    path.write_text(path.read_text().replace(f'"ember_jax": "{ember["ember_jax"]}"', '"ember_jax": "9.9"'))
    with pytest.raises(SystemExit, match="--replan: .* holds figures of ember on .*9.9.*give the --ember-python its "):
        peer.main(["--replan", "--out", str(tmp_path)])
    path.write_text("not json")
    with pytest.raises(SystemExit, match="--replan: .* is not a results file of this benchmark; give the --tag"):
        peer.main(["--replan", "--out", str(tmp_path)])


def test_merge_keeps_the_other_rows_and_refuses_a_foreign_file(tmp_path):
    import argparse
    from importlib import metadata

    args = argparse.Namespace(merge=True, out=tmp_path, maxtext_python=Path(sys.executable), shape="debug",
                              layout="1", precision="fp32", rounds=1, steps=None, warmup=2, profile=False,
                              ember_python=sys.executable, ember_python_shown="python", tag="same-jax",
                              ember={"ember_jax": metadata.version("jax"), "ember_torchax": "0.0.13"})
    row = {"shape": "debug", "precision": "fp32", "layout": "1", "ratio": 1.2}
    peer.write_results([row], args)
    peer.write_results([row | {"layout": "fsdp8", "ratio": 0.9}], args)
    path = peer.write_results([row | {"ratio": 1.3}], args)  # the same row again: replaced, not doubled
    result = json.loads(path.read_text())
    assert path == tmp_path / "maxtext_peer-same-jax-cpu.json"  # --tag names the file
    assert (result["ember_jax"], result["config"]["ember_python"]) == (metadata.version("jax"), "python")
    assert [(r["layout"], r["ratio"]) for r in result["rows"]] == [("fsdp8", 0.9), ("1", 1.3)]
    assert "layout" not in result["config"] and result["config"]["warmup"] == 2
    other = argparse.Namespace(**{**vars(args), "ember": {"ember_jax": "9.9", "ember_torchax": "0.0.13"}})
    with pytest.raises(SystemExit, match="holds figures of ember on .* this run.s is .*9.9.*; give another --tag"):
        peer.write_results([row], other)  # another jax's figures are never merged into these
    path.write_text("not json")
    with pytest.raises(SystemExit, match="is not a results file of this benchmark; move it away or drop --merge"):
        peer.write_results([row], args)
