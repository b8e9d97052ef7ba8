"""benchmarks/peers.py's command line and its checks before any work (its options, their defaults and errors, the
peers' environment), the steady-state step time, the equal-parameter rule, the commit recorded, and the peers'
versions pinned in benchmarks/requirements-peers.txt."""

import json
import re
import subprocess

import pytest

from ember.errors import ConfigError
from tests.helpers import BENCHMARKS, load_benchmark

peers = load_benchmark("peers")


def test_steady_state_drops_the_warmup_steps():
    times = [21.3, 1.06, 0.58, 0.11, 1.05, 1.04]
    assert peers.steady_step_time(times, warmup=2) == pytest.approx((0.58 + 1.04) / 2)
    assert peers.steady_step_time(times, warmup=5) == 1.04
    with pytest.raises(ValueError, match="6 step times, none left after dropping 6 warmup steps"):
        peers.steady_step_time(times, warmup=6)


def test_unequal_parameter_counts_are_refused():
    peers.check_param_counts("debug", {"ember": 6_030_592, "litgpt": 6_030_592, "torchtitan": 6_030_592})
    with pytest.raises(ConfigError, match="shape debug: ember builds 6,030,592 parameters but torchtitan "
                                          "6,031,104: not the same model"):
        peers.check_param_counts("debug", {"ember": 6_030_592, "litgpt": 6_030_592, "torchtitan": 6_031_104})


def test_bf16_is_skipped_only_on_a_cpu_without_bf16_instructions():
    reason = peers.bf16_skip_reason("cpu", force=False, native=False)
    assert reason.startswith("this CPU has no bf16 matmul instructions") and "--force-bf16" in reason
    assert peers.bf16_skip_reason("cpu", force=True, native=False) is None
    assert peers.bf16_skip_reason("cpu", force=False, native=True) is None
    assert peers.bf16_skip_reason("cuda", force=False, native=False) is None


def test_a_missing_peers_environment_names_the_setup_commands(tmp_path):
    with pytest.raises(ConfigError) as raised:
        peers.env.find_peers_python(None, {}, repo=tmp_path)
    assert str(raised.value) == (
        f"no peers environment: {tmp_path}/.venv-peers/bin/python does not exist; set one up with `python -m venv "
        ".venv-peers && .venv-peers/bin/pip install torch==2.13.0 && .venv-peers/bin/pip install torch==2.13.0 -r "
        "benchmarks/requirements-peers.txt` (or point --peers-python or EMBER_PEERS_PYTHON at a python that has "
        "litgpt and torchtitan)")
    python = tmp_path / "python"
    python.touch()
    assert peers.env.find_peers_python(None, {"EMBER_PEERS_PYTHON": str(python)}, repo=tmp_path) == python
    assert peers.env.find_peers_python(str(python), {"EMBER_PEERS_PYTHON": "/nowhere"}, repo=tmp_path) == python


@pytest.mark.parametrize("flag, value", [("--rounds", "0"), ("--timeout", "0"), ("--warmup", "-2")])
def test_counts_and_the_timeout_are_refused_when_they_leave_nothing_to_measure(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} {value}: must be"):
        peers.parse_args([flag, value])


def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="a file, not a folder"):
        peers.parse_args(["--out", str(tmp_path / "f")])


def test_steps_must_outlast_the_warmup():
    with pytest.raises(ConfigError, match="--steps 5 leaves no step after the 5 warmup steps"):
        peers.parse_args(["--steps", "5"])


@pytest.mark.parametrize("argv, message", [
    (["--steps", "3", "--warmup", "2"], "--steps 3 leaves no step after the 4 warmup steps of --warmup-compiled (its "
                                        "default: --warmup + 2): raise --steps, lower --warmup-compiled, or run "
                                        "--modes eager"),
    (["--steps", "3", "--warmup", "1", "--warmup-compiled", "3"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup-compiled: raise --steps, lower "
     "--warmup-compiled, or run --modes eager"),
    (["--steps", "3", "--warmup", "3", "--modes", "eager"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup: raise --steps, or lower --warmup"),
    (["--steps", "3", "--warmup", "3", "--warmup-compiled", "1"],
     "--steps 3 leaves no step after the 3 warmup steps of --warmup: raise --steps, lower --warmup, or run "
     "--modes compiled")])
def test_too_few_steps_name_the_warmup_option_that_takes_them_and_the_ways_out(argv, message):
    with pytest.raises(ConfigError) as raised:
        peers.parse_args(argv)
    assert str(raised.value) == message


def test_only_the_modes_that_run_drop_warmup_steps():
    # compiled alone: --warmup (an eager run's) takes nothing from it
    args = peers.parse_args(["--modes", "compiled", "--steps", "6", "--warmup", "8", "--warmup-compiled", "2"])
    assert (args.steps, args.warmup_compiled) == (6, 2)


def test_the_out_option_says_what_it_is(capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("--out OUT the folder the results file peers-<device>.json is written to (default: benchmarks/results, "
            "beside this script); created if missing") in help_text


def test_every_option_says_its_default_and_choices(capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--help"])
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    blocks = [" ".join(block.split()) for block in re.split(r"\n(?=  -)", options) if "--help" not in block]
    assert len(blocks) == 13 and all("(default: " in block for block in blocks), blocks
    assert "--precisions PRECISIONS comma-separated, of fp32, bf16 (default: fp32,bf16;" in blocks[1]
    assert blocks[8] == "--device {cpu,cuda} where every framework trains, cpu or cuda (default: cpu)"
    # the string defaults still arrive as lists
    args = peers.parse_args([])
    assert (args.shapes, args.precisions, args.modes, args.frameworks) == (
        ["debug", "56m", "128k"], ["fp32", "bf16"], ["eager", "compiled"], ["ember", "litgpt", "torchtitan"])


def test_the_commit_is_heads_marked_dirty_by_any_change_and_none_without_git(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "a.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert peers.env.git_commit(repo) == head
    (repo / "b.py").write_text("b = 1\n")  # untracked: the code that runs is not the commit's alone
    assert peers.env.git_commit(repo) == f"{head}-dirty"
    not_a_checkout = tmp_path / "plain"
    not_a_checkout.mkdir()
    assert peers.env.git_commit(not_a_checkout) is None
    monkeypatch.setenv("PATH", str(not_a_checkout))  # no git to run
    assert peers.env.git_commit(repo) is None


def _pins() -> dict[str, str]:
    lines = (BENCHMARKS / "requirements-peers.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line.strip() and not line.startswith("#"))


def test_every_peers_requirement_is_pinned_at_the_versions_of_the_committed_results():
    text = (BENCHMARKS / "requirements-peers.txt").read_text()
    requirements = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert requirements and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^=\s]+", line) for line in requirements), requirements
    committed = json.loads((BENCHMARKS / "results" / "peers-cpu.json").read_text())
    pins = _pins()
    assert (pins["litgpt"], pins["torchtitan"]) == (committed["litgpt"], committed["torchtitan"]) == ("0.5.13", "0.3.0")
    # torch is named on the pip lines (so that pip keeps the CPU wheel): the same in the file, the setup error
    # and the results' torch
    assert "pip install torch==2.13.0" in text and "torch==2.13.0" in peers.env.SETUP
    assert committed["torch"].startswith("2.13.0") and "torch" not in pins


def test_the_peer_versions_come_from_the_runs_else_from_the_peers_environment(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 9.9.9\n")
    python.chmod(0o755)
    assert peers.env.peer_versions(["torchtitan 0.3.0"], ["ember", "litgpt", "torchtitan"], python) == {
        "torchtitan": "0.3.0", "litgpt": "9.9.9"}
    assert peers.env.peer_versions([], ["ember", "litgpt"], None) == {}
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert peers.env.peer_versions([], ["litgpt"], broken) == {}  # no version is better than a wrong one
