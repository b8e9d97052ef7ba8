"""`ember launch xpk` and `ember launch tpu-vm`: the commands they build, the chip count of a TPU type, and the
one-line errors said before anything runs (the library directly; the command line in the slow tests)."""

from __future__ import annotations

import os
import re
import shlex
from datetime import datetime
from pathlib import Path

import pytest

from ember.errors import ConfigError, EmberError
from ember.launch import tpu
from tests.helpers import run_ember

IMAGE = "gcr.io/my-project/ember:1"


# debug's batch for up to 512 chips: the launchers check global_batch_size against the mesh the chips make
FITS = ["global_batch_size=512", "micro_batch_size=1"]
STOP_ENV = ["--env", "EMBER_EXIT_CODE_ON_STOP=75"]


def xpk_job(**changes) -> tpu.XpkJob:
    fields = dict(cluster="c1", tpu_type="v6e-256", docker_image=IMAGE, workload="ember-debug-1")
    return tpu.XpkJob(**{**fields, **changes})


def test_the_chips_of_a_tpu_type():
    # v6e and v5e (v5litepod) count chips; v4 and v5p count TensorCores, two per chip; a topology counts chips.
    cases = {"v6e-256": 256, "v6e-8": 8, "v5litepod-16": 16, "v5p-128": 64, "v5p-8": 4, "v4-8": 4, "v4-2048": 1024,
             "v6e-4x4": 16, "v5p-2x2x1": 4, "v5p-4x4x8": 128}
    assert {name: tpu.tpu_chips(name) for name in cases} == cases
    with pytest.raises(ConfigError, match=r"^--tpu-type 'v5p-7': a v5p type counts TensorCores, 2 per chip, so its "
                       r"number is even \(e\.g\. v5p-8\)$"):
        tpu.tpu_chips("v5p-7")
    for name in ("v6e-3x3", "v6e-8x32", "v5litepod-4x2"):
        with pytest.raises(ConfigError, match=rf"^--tpu-type '{name}': a v\w+ slice's topology is one of 1x1, 2x2, "
                           r"2x4, 4x4, 4x8, 8x8, 8x16, 16x16; give one of those or the chips \(e\.g\. v\w+-256\)$"):
            tpu.tpu_chips(name)
    for name in ("v6e-255", "v6e-2", "v5litepod-512"):
        with pytest.raises(ConfigError, match=rf"^--tpu-type '{name}': a v\w+ slice has 1, 4, 8, 16, 32, 64, 128 or "
                           r"256 chips; give one of those \(more chips: several slices, --num-slices\)$"):
            tpu.tpu_chips(name)
    for name in ("v5e-16", "h100-8", "v6e", "v6e-0", "V6E-8", "v6e-4x"):
        with pytest.raises(ConfigError, match=rf"^--tpu-type '{name}' is not a TPU type ember knows; give v4-N, "
                           r"v5p-N, v5litepod-N, v6e-N \(e\.g\. v6e-256, v5p-128; v5e is v5litepod-N\)"):
            tpu.tpu_chips(name)


def test_the_xpk_command():
    argv = tpu.xpk_argv(xpk_job(num_slices=2, project="p1", zone="us-east5-b", priority="high"), "debug",
                        ["max_steps=10", "device=tpu", *FITS])
    assert argv == ["xpk", "workload", "create", "--cluster", "c1", "--workload", "ember-debug-1", "--tpu-type",
                    "v6e-256", "--num-slices", "2", "--docker-image", IMAGE, "--command",
                    # device=tpu once, first; the slices replicate (dcn_mesh.data) when no dcn_mesh axis is named
                    "ember train debug device=tpu max_steps=10 global_batch_size=512 micro_batch_size=1 "
                    "dcn_mesh.data=2",
                    "--project", "p1", "--zone", "us-east5-b", "--priority", "high", *STOP_ENV]
    # One slice, XPK's defaults for project, zone and priority; a dcn_mesh axis given is kept as given.
    assert tpu.xpk_argv(xpk_job(tpu_type="v5p-128"), "debug", FITS) == [
        "xpk", "workload", "create", "--cluster", "c1", "--workload", "ember-debug-1", "--tpu-type", "v5p-128",
        "--num-slices", "1", "--docker-image", IMAGE, "--command",
        "ember train debug device=tpu global_batch_size=512 micro_batch_size=1", *STOP_ENV]
    # Restarts after a failure or a preemption (a stopped host exits 75): each resumes from the last checkpoint.
    argv = tpu.xpk_argv(xpk_job(max_restarts=3), "debug", FITS)
    assert argv[-5:] == [*STOP_ENV, "--max-restarts", "3", "--restart-on-user-code-failure"]
    with pytest.raises(ConfigError, match=r"^--max-restarts must be >= 0, got -1$"):
        tpu.xpk_argv(xpk_job(max_restarts=-1), "debug", FITS)
    argv = tpu.xpk_argv(xpk_job(num_slices=4), "debug", ["dcn_mesh.fsdp=2", "dcn_mesh.data=2", "global_batch_size=1024",
                                                         "micro_batch_size=1"])
    assert argv[argv.index("--command") + 1] == ("ember train debug device=tpu dcn_mesh.fsdp=2 dcn_mesh.data=2 "
                                                 "global_batch_size=1024 micro_batch_size=1")
    with pytest.raises(ConfigError, match=r"^global_batch_size=8 is not divisible by micro_batch_size x data-parallel "
                       r"size = 8 x 256 = 2048; change global_batch_size or micro_batch_size$"):
        tpu.xpk_argv(xpk_job(), "debug", [])  # what every TPU host would refuse at start-up


def test_a_value_with_spaces_stays_one_word():
    argv = tpu.xpk_argv(xpk_job(), "debug", ["metrics.wandb_name=my run", "data.dataset=/data/it's.jsonl", *FITS])
    command = argv[argv.index("--command") + 1]
    assert command == ("ember train debug device=tpu 'metrics.wandb_name=my run' "
                       "'data.dataset=/data/it'\"'\"'s.jsonl' global_batch_size=512 micro_batch_size=1")
    assert shlex.split(command) == ["ember", "train", "debug", "device=tpu", "metrics.wandb_name=my run",
                                    "data.dataset=/data/it's.jsonl", *FITS]
    vm = tpu.TpuVm(name="t1", zone="z", workdir="/opt/my runs")
    command = tpu.tpu_vm_argv(vm, "debug", ["metrics.wandb_name=my run"])[-1]
    assert command == "cd '/opt/my runs' && ember train debug device=tpu 'metrics.wandb_name=my run'"


def test_the_tpu_vm_command():
    vm = tpu.TpuVm(name="my-tpu", zone="us-east5-b", project="p1", workdir="~/ember", tpu_type="v6e-16")
    assert tpu.tpu_vm_argv(vm, "debug", ["max_steps=10", *FITS]) == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-east5-b", "--project", "p1",
        "--worker=all", "--command",
        "cd ~/ember && ember train debug device=tpu max_steps=10 global_batch_size=512 micro_batch_size=1"]
    assert tpu.tpu_vm_argv(tpu.TpuVm(name="my-tpu", zone="z"), "debug", []) == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "z", "--worker=all", "--command",
        "ember train debug device=tpu"]
    # The remote shell expands a leading ~ (the workers' home), so it is left unquoted; the rest is quoted.
    assert [tpu.remote_dir(p) for p in ("~", "~/", "~/a b", "a b", "/x")] == ["~", "~/", "~/'a b'", "'a b'", "/x"]


def test_the_mesh_is_checked_for_the_tpus_chips_and_slices():
    with pytest.raises(ConfigError) as err:
        tpu.xpk_argv(xpk_job(num_slices=2), "debug", ["dcn_mesh.data=3"])
    assert str(err.value) == ("the dcn_mesh degrees (dcn_mesh.data=3) multiply to 3, but --num-slices is 2; run 3 "
                              "slices (--num-slices 3) or 2, with degrees that multiply to 2 (e.g. dcn_mesh.data=2)")
    with pytest.raises(ConfigError) as err:  # the 405B recipe's two slices asked of one
        tpu.xpk_argv(xpk_job(), "llama3.1-405b-2xv6e-256", [])
    assert str(err.value).endswith("run 2 slices (--num-slices 2) or one, with dcn_mesh.fsdp=1")
    # A dcn_mesh axis of -1 takes what ici_mesh leaves: here 8 slices' worth of the 512 chips, not 2.
    with pytest.raises(ConfigError, match=r"^the dcn_mesh degrees \(dcn_mesh.data=8\) multiply to 8, but "):
        tpu.xpk_argv(xpk_job(num_slices=2), "debug", ["dcn_mesh.data=-1", "ici_mesh.fsdp=64"])
    with pytest.raises(ConfigError, match=r"^the world size 256 is not divisible by the product of the other mesh "
                       r"axes \(3\), .* \(here the devices are the TPU's chips: 256 x 1 slice = 256\)$"):
        tpu.xpk_argv(xpk_job(), "debug", ["ici_mesh.tensor=3"])
    with pytest.raises(ConfigError, match=r"^the dcn_mesh degrees \(dcn_mesh.data=2\) span slices, but a TPU VM is "
                       "one slice"):
        tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z"), "debug", ["dcn_mesh.data=2"])
    # Without --tpu-type a TPU VM's chips are unknown: the degrees as given are checked against the model, not
    # against a device count.
    assert tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z"), "debug", ["ici_mesh.tensor=2"])[-1].endswith("tensor=2")
    with pytest.raises(ConfigError, match=r"^tensor-parallel degree 3 does not divide model.n_heads=8"):
        tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z"), "debug", ["ici_mesh.tensor=3"])
    with pytest.raises(ConfigError, match=r"^the world size 16 is not divisible .* \(here the devices are the TPU's "
                       r"chips: 16 x 1 slice = 16\)$"):
        tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z", tpu_type="v6e-16"), "debug", ["ici_mesh.tensor=3"])


def test_the_config_and_flags_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"^device=cuda: `ember launch xpk` runs device=tpu on every TPU host; "
                       "drop device=cuda$"):
        tpu.xpk_argv(xpk_job(), "debug", ["device=cuda"])
    with pytest.raises(ConfigError, match="unknown config key"):
        tpu.xpk_argv(xpk_job(), "debug", ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="--num-slices must be >= 1, got 0"):
        tpu.xpk_argv(xpk_job(num_slices=0), "debug", [])
    # output_dir and resume are the hosts' paths: a directory this machine cannot write is not a reason to refuse.
    argv = tpu.xpk_argv(xpk_job(), "debug", [*FITS, "output_dir=/proc/not-here", f"resume={tmp_path}/nowhere/step-5"])
    assert argv[argv.index("--command") + 1].endswith(f"output_dir=/proc/not-here resume={tmp_path}/nowhere/step-5")


def test_workload_names():
    for name in ("Ember", "ember_1", "1ember", "ember-", "e" * 41):
        with pytest.raises(ConfigError, match=rf"^--workload '{name}': XPK takes lowercase letters, digits and '-', "
                           rf"starting with a letter and ending with a letter or digit, at most 40 characters "
                           rf"\({len(name)} here\)"):
            tpu.check_workload(name)
    tpu.check_workload("e" * 40)
    now = datetime(2026, 11, 25, 21, 38, 51)
    assert tpu.default_workload("ember-llama3-1-8b", now) == "ember-llama3-1-8b-20261125-213851"
    long = tpu.default_workload("ember-" + "a" * 17 + "-" + "b" * 20, now)
    assert long == "ember-" + "a" * 17 + "-20261125-213851" and len(long) == 39  # a '-' left at the cut goes
    assert len(tpu.default_workload("ember-" + "c" * 60, now)) == 40
    assert tpu.default_workload("ember-maxtext-16b-v5e-256", now) == "ember-maxtext-16b-v5e-20261125-213851"
    tpu.check_workload(long)


def test_print_runs_nothing_and_a_missing_tool_is_one_line(monkeypatch, capsys):
    argv = ["xpk", "workload", "create", "--command", "ember train debug device=tpu 'a=b c'"]
    assert tpu.print_or_run(argv, dry_run=True) == 0
    out, err = capsys.readouterr()
    assert out == shlex.join(argv) + "\n" and shlex.split(out) == argv and err.count("\n") == 1
    monkeypatch.setenv("PATH", "")
    for tool, hint in (("xpk", "pip install xpk"), ("gcloud", "install the Google Cloud CLI")):
        with pytest.raises(EmberError, match=rf"^`{tool}` is not on PATH: {hint}"):
            tpu.print_or_run([tool, "x"], dry_run=False)


def _no_tools_env() -> dict[str, str]:
    return {**os.environ, "PATH": ""}  # run_ember starts sys.executable by its full path


XPK = ["launch", "xpk", "--cluster", "c1", "--tpu-type", "v6e-256", "--docker-image", IMAGE]
TPU_VM = ["launch", "tpu-vm", "--name", "my-tpu", "--zone", "us-east5-b"]


@pytest.mark.slow
def test_the_command_line():
    for argv in (["launch", "xpk", "--help"], ["launch", "tpu-vm", "--help"]):
        proc = run_ember(*argv)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: ember {' '.join(argv[:2])}"), proc.stderr
    # --print: the command alone on stdout; overrides may come before or after the flags.
    proc = run_ember(*XPK, "debug", "metrics.wandb_name=my run", *FITS, "--num-slices", "2", "--print")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    workload = words[words.index("--workload") + 1]
    assert re.fullmatch(r"ember-debug-\d{8}-\d{6}", workload)
    assert words == ["xpk", "workload", "create", "--cluster", "c1", "--workload", workload, "--tpu-type", "v6e-256",
                     "--num-slices", "2", "--docker-image", IMAGE, "--command",
                     "ember train debug device=tpu 'metrics.wandb_name=my run' global_batch_size=512 "
                     "micro_batch_size=1 dcn_mesh.data=2", *STOP_ENV]
    proc = run_ember(*TPU_VM, "--workdir", "~/ember", "debug", "max_steps=5", "--dry-run")
    assert (proc.returncode, proc.stdout) == (0, "gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-b "
                                              "--worker=all --command 'cd ~/ember && ember train debug device=tpu "
                                              "max_steps=5'\n")
    # A mesh that does not multiply, a missing tool: one line, exit 2.
    proc = run_ember(*XPK, "--num-slices", "2", "debug", "dcn_mesh.data=3", "--print")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: the dcn_mesh degrees (dcn_mesh.data=3) multiply to 3, but --num-slices is 2; run 3 "
                           "slices (--num-slices 3) or 2, with degrees that multiply to 2 (e.g. dcn_mesh.data=2)\n")
    for argv, tool in ((XPK, "xpk"), (TPU_VM, "gcloud")):
        proc = run_ember(*argv, "debug", *FITS, env=_no_tools_env())
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: `{tool}` is not on PATH: ")
    proc = run_ember(*XPK, "--workload", "Bad_Name", "debug", "--print")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --workload 'Bad_Name': ")


def _doc_examples() -> list[list[str]]:
    """The `ember launch xpk|tpu-vm` lines of docs/tpu-launch.md's bash blocks, continuations joined."""
    page = Path(__file__).parents[2] / "docs" / "tpu-launch.md"
    lines = [line for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("ember launch")]


def test_the_docs_examples_run_as_written(capsys):
    from ember import cli

    examples = _doc_examples()
    assert [argv[:2] for argv in examples] == [["launch", "xpk"], ["launch", "xpk"], ["launch", "tpu-vm"]]
    outputs = []
    for argv in examples:
        assert "--print" in argv and cli.main(argv) == 0, (argv, capsys.readouterr().err)
        outputs.append(capsys.readouterr().out)
    page = (Path(__file__).parents[2] / "docs" / "tpu-launch.md").read_text()
    assert outputs[1] in page  # the output the page shows is the second example's


@pytest.mark.parametrize("override, says", [("ici_mesh.pipeline=2", "no pipeline parallelism"),
                                            ("lora.rank=4", "lora.rank is not supported with device=tpu"),
                                            ("model.remat=bogus", "model.remat 'bogus' is not one of"),
                                            ("model.head_dim=33", "model.head_dim=33 must be a positive even number"),
                                            ("seq_len=8192", "seq_len=8192 exceeds the model's max_seq_len=2048")])
def test_what_the_tpu_hosts_would_refuse_is_refused_before_submitting(override: str, says: str):
    for build in (lambda: tpu.xpk_argv(xpk_job(), "debug", [*FITS, override]),
                  lambda: tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z"), "debug", [*FITS, override]),
                  lambda: tpu.tpu_vm_argv(tpu.TpuVm(name="t", zone="z", tpu_type="v6e-8"), "debug", [*FITS, override])):
        with pytest.raises(ConfigError, match=says):
            build()
