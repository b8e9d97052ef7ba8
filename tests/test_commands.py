"""Every `ember` command and subcommand, in process (ember.cli.main): --help on stdout with 0, a usage mistake as
one line on stderr with 2, the one error handling of ember/commands/__init__.py, and `ember eval`'s eval.* keys
read through the config's EvalConfig section. One subprocess runs the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from ember import cli
from ember.errors import ConfigError


def _subcommands() -> list[list[str]]:
    """Every command and subcommand of `ember`, from the parsers themselves."""
    from ember.commands import COMMANDS, data as data_command, launch as launch_command

    commands = [[name] for name in COMMANDS]
    commands += [["launch", name] for name in launch_command.parser()[1]]
    data = data_command.parser()._subparsers._group_actions[0].choices
    commands += [["data", name] for name in data]
    commands += [["data", name, sub] for name, p in data.items() if p._subparsers
                 for sub in p._subparsers._group_actions[0].choices]
    return commands


SUBCOMMANDS = _subcommands()


def test_the_walk_finds_every_subcommand():
    assert len(SUBCOMMANDS) == 21 and ["launch", "local"] in SUBCOMMANDS and ["launch", "k8s"] in SUBCOMMANDS
    assert ["launch", "xpk"] in SUBCOMMANDS and ["launch", "tpu-vm"] in SUBCOMMANDS
    assert ["data", "tokenizer", "train"] in SUBCOMMANDS and ["train"] in SUBCOMMANDS and ["eval"] in SUBCOMMANDS


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_help_is_on_stdout_with_0(command: list[str], capsys: pytest.CaptureFixture):
    assert cli.main([*command, "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: ember {' '.join(command)}") and err == "", (out, err)


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_an_unknown_flag_is_one_line_on_stderr_with_2_naming_it(command: list[str], capsys: pytest.CaptureFixture):
    """Named even where the command also misses a required argument (`ember plan --no-such-flag` lacks --world):
    the flag is the mistake, the missing argument its consequence."""
    assert cli.main([*command, "--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "--no-such-flag" in err, err


def test_usage_errors_name_the_argument_and_the_help(capsys: pytest.CaptureFixture):
    for argv, message in (
            (["plan", "--no-such-flag"], "unrecognized arguments: --no-such-flag (see ember plan --help)"),
            (["train", "--no-such-flag"], "unknown option '--no-such-flag' for ember train (options: --nproc-per-node, "
             "--nnodes, --node-rank, --rdzv-endpoint, --replica-groups, --max-restarts)"),
            (["recipes", "extra"], "unrecognized arguments: extra (see ember recipes --help)"),
            (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see ember --help)"),
            (["trian"], "unknown command 'trian' (choose from convert, data, eval, generate, launch, plan, recipes, "
             "report, train)"),
            (["plan", "debug", "--world", "2", "--device", "h800"], "argument --device: invalid choice: 'h800' "
             "(choose from 'a100', 'h100', 'h200', 'b200', 'gb200', 'mi300x', 'tpu-v5p', 'tpu-v5e', 'tpu-v6e', "
             "'cpu') (see ember plan --help)"),
            (["plan", "debug", "--world", "two"], "argument --world: invalid int value: 'two' (see ember plan --help)"),
            (["launch", "slurm", "debug", "--nodes", "x"],
             "argument --nodes: invalid int value: 'x' (see ember launch slurm --help)"),
            (["launch", "nowhere"], "argument COMMAND: invalid choice: 'nowhere' (choose from 'local', 'slurm', "
             "'k8s', 'xpk', 'tpu-vm', 'status', 'cancel', 'logs') (see ember launch --help)"),
            (["data", "prepare", "embedded", "out", "--vocab-size", "x"],
             "argument --vocab-size: invalid int value: 'x' (see ember data prepare --help)"),
            (["convert", "a", "b", "--to", "onnx"], "argument --to: invalid choice: 'onnx' (choose from 'hf', "
             "'ember', 'torch', 'peft') (see ember convert --help)"),
            (["generate", "run", "--max-new-tokens", "x"],
             "argument --max-new-tokens: invalid int value: 'x' (see ember generate --help)"),
            (["report", "run", "--bogus"], "unrecognized arguments: --bogus (see ember report --help)"),
            (["eval", "run", "--harness", "x", "--limit", "x"],
             "argument --limit: invalid int value: 'x' (see ember eval --help)")):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr() == ("", f"error: {message}\n"), argv


def test_without_what_they_need_commands_print_their_usage_on_stderr(capsys: pytest.CaptureFixture):
    for command in ([], ["eval"], ["eval", "--nproc-per-node", "2"], ["plan"], ["launch"], ["generate"], ["convert"],
                    ["report"], ["data"], ["launch", "slurm"], ["launch", "k8s"], ["launch", "xpk"],
                    ["launch", "tpu-vm"], ["launch", "status"], ["data", "prepare"]):
        assert cli.main(command) == 2, command
        out, err = capsys.readouterr()
        assert out == "" and "usage" in err.lower(), (command, out, err)


def test_help_after_other_arguments(capsys: pytest.CaptureFixture):
    # `ember train debug --help` (help asked for after a recipe) is help, not an unknown key=value.
    for argv in (["train", "debug", "--help"], ["eval", "run/", "-h"], ["launch", "local", "debug", "-h"]):
        assert cli.main(argv) == 0, argv
        assert "usage" in capsys.readouterr().out.lower(), argv


def test_version(capsys: pytest.CaptureFixture):
    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr() == (f"ember {version('ember')}\n", "")


def test_the_console_script():
    script = shutil.which("ember", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if script is None:
        pytest.skip("the ember console script is not installed (pip install -e .)")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"ember {version('ember')}\n", "")


def test_a_user_error_on_a_rank_goes_to_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture):
    """Under the launcher of ember/launch/local.py a rank's user error is left in its error directory, to be printed
    once for all ranks; under plain torchrun it is printed with the rank; alone, as it is."""
    from ember.launch.local import ERROR_DIR_ENV

    message = "--world must be a positive number of devices, got 0"
    assert cli.main(["plan", "debug", "--world", "0"]) == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["plan", "debug", "--world", "0"]) == 2
    assert capsys.readouterr() == ("", f"error: [rank 1] {message}\n")
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    assert cli.main(["plan", "debug", "--world", "0"]) == 2
    assert capsys.readouterr() == ("", "") and (tmp_path / "rank1.txt").read_text() == message + "\n"


def test_only_argparse_exits_are_usage(monkeypatch: pytest.MonkeyPatch):
    """SystemExit is argparse's answer only while the arguments are parsed; one raised by a command's work keeps
    its code."""
    from ember.commands import report

    def exits(args: object) -> int:
        raise SystemExit(3)

    monkeypatch.setattr(report, "run", exits)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", "some-run"])
    assert exit_.value.code == 3


def test_eval_keys_are_the_configs_eval_section():
    """`ember eval`'s eval.* keys merge into EvalConfig (with ppl's window): one default (limit None: every row,
    as in training), the config's types (null unsets) and its messages for a bad type, and one line naming a bad
    key."""
    from ember.commands.eval import parse
    from ember.config_schema import EvalConfig, EvalOptions
    from ember.train import run as run_lib

    assert run_lib.load_config("debug").eval.limit is None and EvalConfig().limit is None
    options = parse(["run", "lambada=l.jsonl"]).options
    assert isinstance(options, EvalConfig) and (options.limit, options.batch_size) == (None, 16)
    options = parse(["run", "lambada=l.jsonl", "ppl", "eval.limit=5", "eval.batch_size=4", "eval.split=train",
                     "eval.seq_len=64", "eval.limit=null"]).options
    assert options == EvalOptions(limit=None, batch_size=4, split="train", seq_len=64)
    for items, message in (
            (["eval.seq_lenn=5"], "unknown config key 'eval.seq_lenn' (did you mean 'eval.seq_len'?) for ember eval "
             "(keys: eval.limit, eval.batch_size, eval.seq_len, eval.stride, eval.max_tokens, eval.split, data.*, "
             "gen.*)"),
            (["eval.batch_size=x"], "bad value for config key 'eval.batch_size': got 'x' (expected int)"),
            (["eval.limit=2.5"], "bad value for config key 'eval.limit': got 2.5 (expected int or null)"),
            (["eval.stride=0"], "eval.stride must be an integer >= 1, got 0"),
            (["eval.limit=0"], "eval.limit must be an integer >= 1 (leave it unset to score every row), got 0"),
            (["eval.split=test"], "eval.split must be one of val, train, all, got 'test'"),
            (["eval.tasks=[]"], "eval.tasks is the training config's list; name ember eval's tasks as arguments "
             "(ppl, lambada=FILE, boolq=FILE, choice=FILE, gen=FILE)")):
        with pytest.raises(ConfigError) as err:
            parse(["run", "ppl", "lambada=l.jsonl", *items])
        assert str(err.value) == message, items


def test_an_unknown_option_is_named_alone_with_the_commands_options(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Wherever it stands (before PATH, among the tasks, with --harness), ember eval names the option it does not
    have and lists those it has; ember launch slurm names the option alone (argparse lumped the overrides after
    it in with it) and writes nothing."""
    eval_options = ("--output, --tokenizer, --harness, --include-path, --limit, --batch-size, --nproc-per-node, "
                    "--nnodes, --node-rank, --rdzv-endpoint")
    slurm_options = ("--nodes, --gpus-per-node, --nproc-per-node, --partition, --time, --account, --qos, --job-name, "
                     "--container, --mounts, --env, --signal-seconds, --sbatch, --replica-groups, --max-restarts, "
                     "--lighthouse-partition, --wait, --dry-run, --print")
    for argv, message in (
            (["eval", "--bogus"], f"unknown option '--bogus' for ember eval (options: {eval_options})"),
            (["eval", "run", "ppl", "--bogus"], f"unknown option '--bogus' for ember eval (options: {eval_options})"),
            (["eval", "run", "--harness", "x", "--bogus=1"],
             f"unknown option '--bogus' for ember eval (options: {eval_options})"),
            (["eval", "run", "ppl", "--limit", "3"], "--limit is an option of --harness (lm-eval tasks); ember's own "
             "tasks take eval.limit=N and eval.batch_size=N"),
            (["eval", "run", "ppl", "--nproc-per-node", "2"], "--nproc-per-node is a launcher option: give it before "
             "PATH (ember eval --nproc-per-node N PATH ...)"),
            (["launch", "slurm", "debug", "--bogus", "--dry-run", f"output_dir={tmp_path}"],
             f"unknown option '--bogus' for ember launch slurm (options: {slurm_options})"),
            (["launch", "status", "12", "--bogus"],
             "unknown option '--bogus' for ember launch status (it takes none)")):
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr() == ("", f"error: {message}\n"), argv
    assert not (tmp_path / "launch").exists()


def test_eval_options_may_come_before_the_path():
    from ember.commands.eval import parse

    args = parse(["--output", "e.json", "run", "--tokenizer=t.json", "lambada=l.jsonl"])
    assert (args.path, args.output, args.tokenizer, args.tasks) == ("run", "e.json", "t.json", {"lambada": "l.jsonl"})


def test_a_file_where_a_model_directory_goes_is_named_as_not_a_model(tmp_path: Path, capsys: pytest.CaptureFixture):
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "x"}\n')
    assert cli.main(["train", "debug", f"model.init_from={notes}"]) == 2
    assert capsys.readouterr() == ("", f"error: model.init_from '{notes}' is not a model: a model for init_from is a "
                                       "checkpoints/step-N, run or HF directory, not a file\n")
