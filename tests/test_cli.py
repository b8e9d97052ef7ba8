"""The `ember` command itself: help, recipes table, unknown commands."""

import subprocess
import sys


def _ember(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120)


def test_recipes_table_lists_parameter_counts():
    proc = _ember("recipes")
    assert proc.returncode == 0, proc.stderr
    for text in ("llama3.1-405b", "405,853,388,800", "70,553,706,496", "1,235,814,400", "debug", "8192", "1024"):
        assert text in proc.stdout


def test_unknown_command_and_recipe_are_one_line_errors():
    proc = _ember("trian")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown command 'trian'")
    proc = _ember("train", "llama3-8")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean 'llama3-8b'" in proc.stderr
    assert _ember("train", "--help").returncode == 0


def test_every_command_has_help():
    for command in ("train", "recipes", "convert", "data", "generate", "eval"):
        proc = _ember(command, "--help")
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (command, proc.stderr)


def test_only_user_errors_are_one_line(tmp_path):
    # A user's mistake (here a data path that does not exist) is one line; a bug (a ValueError from inside
    # ember, simulated by a broken model class) keeps its traceback instead of being dressed as a user error.
    proc = _ember("train", "data.dataset=" + str(tmp_path / "nowhere"), f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    code = ("import sys, ember.models as m, ember.cli as c\n"
            "class Broken:\n"
            "    def __init__(self, args): raise ValueError('an internal bug')\n"
            "import dataclasses; m.MODELS['llama3'] = dataclasses.replace(m.MODELS['llama3'], model_cls=Broken)\n"
            "sys.exit(c.main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "train", "data.dataset=synthetic", f"output_dir={tmp_path / 'p'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "an internal bug" in proc.stderr


def test_help_after_other_arguments(capsys):
    # `ember train debug --help` (help asked for after a recipe) is help, not an unknown key=value.
    from ember import cli

    for argv in (["train", "debug", "--help"], ["eval", "run/", "-h"], ["recipes", "--help"]):
        assert cli.main(argv) == 0, argv
        assert "usage" in capsys.readouterr().out.lower(), argv
