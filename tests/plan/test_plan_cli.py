"""`ember plan`'s command line: --json and plan.json, --search's candidates, one-line user errors, --help, and an
--output that never replaces a file of the user's."""

import json

import pytest

from ember.cli import main
from ember.plan.planner import make_plan
from ember.train import run as run_lib


@pytest.mark.slow
def test_cli_json_and_plan_json(tmp_path, capsys):
    assert main(["plan", "debug", "--world", "2", "ici_mesh.fsdp=2", "micro_batch_size=4", "--device", "cpu",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 2 and doc["device"] == "cpu" and doc["fits"] is True
    assert [r["coordinate"] for r in doc["ranks"]] == [{"fsdp": 0}, {"fsdp": 1}]
    out = tmp_path / "plan.json"
    assert main(["plan", "debug", f"output_dir={tmp_path}", "--world", "2", "ici_mesh.fsdp=2",
                 "micro_batch_size=4"]) == 0
    printed = capsys.readouterr().out
    assert "verdict: fits" in printed and "plan.json" in printed
    # 8 sequences over 2 data-parallel ranks: 4 is the batch's limit, not memory's, and the verdict says so
    assert ("the largest micro-batch that fits: 4 (the most global_batch_size allows per data-parallel rank)"
            in printed)
    assert "ember plan: fsdp=2 on 2 x h100 (1 node), micro-batch 4" in printed  # not "1 nodes"
    assert json.loads(out.read_text())["device"] == "h100"
    # --json with --output: printed, and written there, the same document
    named = tmp_path / "p2.json"
    argv = ["plan", "debug", "--world", "2", "ici_mesh.fsdp=2", "micro_batch_size=4", "--json", "--output", str(named)]
    assert main(argv) == 0
    assert json.loads(named.read_text()) == json.loads(capsys.readouterr().out) and named.read_text().endswith("}\n")
    # an earlier plan.json is replaced
    assert main(["plan", "debug", "--world", "2", "ici_mesh.fsdp=1", "ici_mesh.data=2", "micro_batch_size=4",
                 "--output", str(named)]) == 0
    assert json.loads(named.read_text())["ranks"][1]["coordinate"] == {"data": 1}


@pytest.mark.slow
def test_search_json_holds_the_candidates_the_table_lists(capsys):
    import io

    from rich.console import Console

    from ember.commands.plan import render

    cfg = run_lib.load_config("debug", ["ici_mesh.fsdp=2", "micro_batch_size=4"], world_size=2)
    plan = make_plan(cfg, 2, device="h100", search=True)
    doc = plan.to_json()
    candidates = doc["candidates"]
    assert {(c["remat"], c["micro_batch_size"]) for c in candidates} == {
        (remat, m) for remat in ("none", "op", "selective", "full") for m in (1, 2, 4)}  # all fit in 72 GiB
    assert all(list(c) == ["remat", "micro_batch_size", "peak_bytes", "step_time_s", "tokens_per_s", "mfu"]
               for c in candidates)
    speeds = [c["tokens_per_s"] for c in candidates]
    assert speeds == sorted(speeds, reverse=True)  # best first
    console = Console(record=True, width=200, file=io.StringIO())
    render(plan, console, None)
    table = console.export_text().split("feasible (remat, micro-batch) by predicted tokens/s")[1]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    assert rows == [[c["remat"], str(c["micro_batch_size"]), f"{c['peak_bytes'] / 2**30:,.2f}",
                     f"{c['step_time_s']:.2f}", f"{c['tokens_per_s']:,.0f}", f"{c['mfu']:.1%}"] for c in candidates]
    # The command's --json is that document; without --search there is no candidates key.
    argv = ["plan", "debug", "--world", "2", "ici_mesh.fsdp=2", "micro_batch_size=4", "--json"]
    assert main(argv + ["--search"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"] == candidates
    assert main(argv) == 0
    assert "candidates" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, message", [
    (["plan", "debug", "--world", "3", "ici_mesh.fsdp=2"], "error: ici_mesh x dcn_mesh"),
    (["plan", "debug", "--world", "2", "ici_mesh.fsdp=2", "model.nope=1"],
     "error: unknown config key 'model.nope' (did you mean 'model.nope_every'?)"),
    (["plan", "debug", "--world", "16", "--nodes", "3", "global_batch_size=128"],
     "error: --nodes 3 does not divide --world 16"),
    (["plan", "debug", "--world", "2", "--device", "tpu-v9"], "error: argument --device: invalid choice: 'tpu-v9' "
     "(choose from 'a100', 'h100', 'h200', 'b200', 'gb200', 'mi300x', 'tpu-v5p', 'tpu-v5e', 'tpu-v6e', 'cpu') "
     "(see ember plan --help)"),
    (["plan", "debug", "--world", "two"], "error: argument --world: invalid int value: 'two' (see ember plan --help)"),
])
def test_cli_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_cli_help(capsys):
    assert main(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "--search" in out and "the device type (default: h100)" in out


def test_cli_output_is_never_a_file_of_the_users(tmp_path, capsys):
    """--output (or OUTPUT_DIR/plan.json) replaces an earlier plan.json only: any other file is refused, before
    the planning, and kept as it was (an earlier plan.json is replaced: test_cli_json_and_plan_json)."""
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "mine"}\n')
    (tmp_path / "plan.json").write_text("not json")
    for argv, target in ((["--output", str(notes)], notes), (["--json", "--output", str(notes)], notes),
                         ([f"output_dir={tmp_path}"], tmp_path / "plan.json")):
        assert main(["plan", "debug", "--world", "2", "--device", "cpu", "ici_mesh.fsdp=2", "micro_batch_size=4",
                     *argv]) == 2
        assert capsys.readouterr() == ("", f"error: {target} exists and is not a plan.json ember wrote; move it aside "
                                           "or pass another --output\n")
    assert notes.read_text() == '{"text": "mine"}\n' and (tmp_path / "plan.json").read_text() == "not json"
