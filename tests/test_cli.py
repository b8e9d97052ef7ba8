"""The `ember` command in a subprocess: the recipes table, unknown commands, user errors against bugs, and the
README's plan and launch examples. Every subcommand's --help and usage errors: tests/test_commands.py."""

import subprocess
import sys

import pytest

from tests.helpers import run_ember

# Every test here runs `ember` in subprocesses (the README examples: about a minute).
pytestmark = pytest.mark.slow


def test_recipes_table_lists_parameter_counts():
    proc = run_ember("recipes")
    assert proc.returncode == 0, proc.stderr
    for text in ("llama3.1-405b", "405,853,388,800", "70,553,706,496", "1,235,814,400", "debug", "8192", "1024"):
        assert text in proc.stdout


def test_unknown_command_and_recipe_are_one_line_errors():
    proc = run_ember("trian")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown command 'trian'")
    proc = run_ember("train", "llama3-8")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "did you mean 'llama3-8b'" in proc.stderr
    assert run_ember("train", "--help").returncode == 0


def test_only_user_errors_are_one_line(tmp_path):
    # A user's mistake (here a data path that does not exist) is one line; a bug (a ValueError from inside
    # ember, simulated by a broken model class) keeps its traceback instead of being dressed as a user error.
    proc = run_ember("train", "data.dataset=" + str(tmp_path / "nowhere"), f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    code = ("import sys, ember.models as m, ember.cli as c\n"
            "class Broken:\n"
            "    def __init__(self, args): raise ValueError('an internal bug')\n"
            "import dataclasses; m.MODELS['llama3'] = dataclasses.replace(m.MODELS['llama3'], model_cls=Broken)\n"
            "sys.exit(c.main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "train", "data.dataset=synthetic",
                           f"output_dir={tmp_path / 'p'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "an internal bug" in proc.stderr


def _readme_commands(*commands: str) -> list[list[str]]:
    """The `ember COMMAND ...` lines in the bash blocks of README.md and docs/*.md, as argv (continuations joined,
    comments cut), each distinct command once, in the order the pages give them."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).parent.parent
    lines = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            lines += block.replace("\\\n", " ").splitlines()
    words = [shlex.split(line, comments=True) for line in lines]
    examples = [w[1:] for w in words if len(w) > 1 and w[0] == "ember" and w[1] in commands]
    return [argv for i, argv in enumerate(examples) if argv not in examples[:i]]


def test_the_readme_plan_and_launch_examples_run_as_written(tmp_path, monkeypatch, capsys):
    """Each example as the README writes it; those that would submit or train stop at that point: slurm submission
    with --dry-run added, xpk and tpu-vm with --print, `launch local` at the torchrun call, `launch logs` on a job
    scontrol describes."""
    import json
    from pathlib import Path

    import torch.distributed.run

    from ember import cli
    from ember.launch import slurm

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_example_value_for_the_readme_test")  # `--env HF_TOKEN` wants it set
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    started = []
    monkeypatch.setattr(torch.distributed.run, "main", started.append)
    from ember.launch import replica_groups

    groups_started = []  # --replica-groups: the lighthouse and the groups' torchruns are not started
    monkeypatch.setattr(replica_groups, "launch_replica_groups", lambda *args: groups_started.append(args) or 0)
    log = tmp_path / "job.out"
    log.write_text("ember: job 1234 started\n")
    monkeypatch.setattr(slurm, "job_info", lambda job_id, strict=False: {
        "JobId": job_id, "JobState": "COMPLETED", "ExitCode": "0:0", "StdOut": str(log)})
    examples = _readme_commands("plan", "launch")
    kinds = {e[0] if e[0] == "plan" else " ".join(e[:2]) for e in examples}
    assert kinds == {"plan", "launch local", "launch slurm", "launch k8s", "launch xpk", "launch tpu-vm",
                     "launch logs"}, examples
    tpu_programs = {"xpk": "xpk workload create ", "tpu-vm": "gcloud compute tpus tpu-vm ssh "}
    for argv in examples:
        if argv[:2] == ["launch", "slurm"] and "--dry-run" not in argv:
            argv = [*argv, "--dry-run"]
        if argv[0] == "launch" and argv[1] in tpu_programs and not {"--print", "--dry-run"} & set(argv):
            argv = [*argv, "--print"]
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
        out, err = capsys.readouterr()
        if argv[0] == "plan" and "--json" in argv:
            assert json.loads(out)["world_size"] == int(argv[argv.index("--world") + 1])
        elif argv[0] == "plan":
            assert "verdict: fits" in out, argv
        elif argv[:2] == ["launch", "local"] and "--replica-groups" in argv:
            recipe_argv, _, _, groups, nproc, restarts, _ = groups_started[-1]
            assert (groups, nproc, restarts) == (2, 1, 3)
            assert recipe_argv[-2:] == ["fault_tolerance.enable=true", "fault_tolerance.replica_groups=2"]
        elif argv[:2] == ["launch", "local"]:
            assert started[-1][:4] == ["--nproc-per-node", "2", "--nnodes", "1"]
        elif argv[:2] == ["launch", "logs"]:
            assert out == "ember: job 1234 started\n"
        elif argv[0] == "launch" and argv[1] in tpu_programs:  # the one command line, printed and not run
            assert out.startswith(tpu_programs[argv[1]]) and out.count("\n") == 1 and "device=tpu" in out, argv
            assert err.startswith("not run (--print)"), (argv, err)
        else:
            assert err.startswith("requesting "), (argv, err)
    assert Path("outputs/llama3.1-8b/launch/ember-llama3-1-8b.yaml").is_file()
