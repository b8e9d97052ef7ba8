"""A run is exactly what the user asked for: init_from takes the source's architecture, starting over never
mixes with an old run, a checkpoint of another model is refused by name, and errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from ember.checkpoint.run_dir import archive_previous_run
from ember.config import ConfigError
from ember.model_io.convert import save_ember_checkpoint
from ember.models import build_model_args
from ember.models.llama import Transformer
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import read_records, run_ember, tiny_model

TINY = ["data.dataset=synthetic", *tiny_model(2), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=2", "logging_steps=1", "checkpoint.interval=2", "eval_batches=1", "metrics.console=false"]


def _hf_llama(directory: Path) -> transformers.LlamaForCausalLM:
    """A transformers Llama whose config differs from every ember flavor: RoPE base 10,000, eps 1e-6, FFN 176."""
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=176, vocab_size=512, max_position_embeddings=64,
                                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def test_init_from_an_hf_directory_takes_its_whole_architecture(tmp_path: Path):
    hf_dir = tmp_path / "hf"
    hf_model = _hf_llama(hf_dir)
    # Nothing restated: dim, layers, heads, FFN size, vocabulary, RoPE base and eps all come from config.json.
    cfg = run_lib.load_config("debug", ["data.dataset=synthetic", "seq_len=16", "max_steps=1", "metrics.console=false",
                                    f"model.init_from={hf_dir}", f"output_dir={tmp_path / 'out'}"])
    trainer = Trainer(cfg)
    args = trainer.spec.args
    assert (args.dim, args.n_layers, args.ffn_hidden_dim, args.vocab_size) == (64, 2, 176, 512)
    assert (args.rope_theta, args.norm_eps) == (10000.0, 1e-6)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(tokens), hf_model(tokens).logits, rtol=1e-5, atol=1e-5)
    assert trainer.spec.architecture_from == str(hf_dir / "config.json")
    trainer.train_loader.close()
    # An override that contradicts config.json is refused, naming the key and both values.
    with pytest.raises(ConfigError, match=r"model\.rope_theta=500000\.0 contradicts model\.init_from .*config\.json "
                                          r"\(rope_theta 10000\.0\)"):
        run_lib.load_config("debug", ["data.dataset=synthetic", "seq_len=16", f"model.init_from={hf_dir}",
                                  "model.rope_theta=500000.0", f"output_dir={tmp_path / 'o2'}"])
    with pytest.raises(ConfigError, match=r"model\.ffn_hidden_dim=704 contradicts .*\(ffn_hidden_dim 176\)"):
        run_lib.load_config("debug", ["data.dataset=synthetic", "seq_len=16", f"model.init_from={hf_dir}",
                                  "model.ffn_hidden_dim=704", f"output_dir={tmp_path / 'o3'}"])
    # A RoPE model's table length is not a weight: a longer max_seq_len is allowed.
    cfg = run_lib.load_config("debug", ["data.dataset=synthetic", "seq_len=16", f"model.init_from={hf_dir}",
                                    "model.max_seq_len=128", f"output_dir={tmp_path / 'o4'}"])
    assert run_lib.model_choice(cfg).args.max_seq_len == 128


@pytest.mark.slow
def test_the_run_header_and_export_keep_the_source_architecture(tmp_path: Path):
    hf_dir = tmp_path / "hf"
    _hf_llama(hf_dir)
    out = tmp_path / "out"
    proc = run_ember("train", "debug", "data.dataset=synthetic", "seq_len=16", "max_steps=2", "optim.lr=1e-12",
                     f"model.init_from={hf_dir}", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert f"model: initialised from {hf_dir} (architecture from {hf_dir / 'config.json'})" in proc.stdout
    assert run_ember("convert", str(out), str(tmp_path / "hf2")).returncode == 0
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert exported["rope_theta"] == 10000.0 and exported["rms_norm_eps"] == 1e-6
    assert exported["intermediate_size"] == 176


@pytest.mark.slow
def test_resume_none_moves_the_old_run_aside(tmp_path: Path):
    out = tmp_path / "r"
    assert run_ember("train", "debug", *TINY, "max_steps=6", f"output_dir={out}").returncode == 0
    proc = run_ember("train", "debug", *TINY, "max_steps=3", "resume=none", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    (previous,) = out.glob("previous-*")
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]  # keep=3
    assert f"moved to {previous}" in proc.stdout
    # A plain run continues the second run (step 3), not the first (step 6).
    proc = run_ember("train", "debug", *TINY, "max_steps=5", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step-3" in proc.stdout and "nothing to train" not in proc.stdout
    steps = [r["step"] for r in read_records(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]  # one series: the first run's metrics went with its checkpoints
    assert len((previous / "metrics.jsonl").read_text().splitlines()) >= 6


@pytest.mark.slow
def test_a_crashed_runs_extra_records_are_dropped_on_resume(tmp_path: Path):
    out = tmp_path / "r"
    assert run_ember("train", "debug", *TINY, "max_steps=4", f"output_dir={out}").returncode == 0
    metrics = out / "metrics.jsonl"
    # As if the run had logged steps 5 and 6, then died before its next checkpoint.
    metrics.write_text(metrics.read_text() + json.dumps({"step": 5, "loss": 1.0}) + "\n"
                       + json.dumps({"step": 6, "loss": 1.0}) + "\n")
    assert run_ember("train", "debug", *TINY, "max_steps=6", f"output_dir={out}").returncode == 0
    steps = [r["step"] for r in read_records(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(3, 2), (2, 3)])
def test_a_checkpoint_of_another_shape_is_refused_by_name(tmp_path: Path, before: int, after: int):
    out = tmp_path / "r"
    proc = run_ember("train", "debug", *TINY, "max_steps=2", f"model.n_layers={before}", f"output_dir={out}")
    assert proc.returncode == 0
    proc = run_ember("train", "debug", *TINY, "max_steps=4", f"model.n_layers={after}", f"output_dir={out}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"n_layers: checkpoint {before}, this run {after}" in proc.stderr and "resume=none" in proc.stderr
    assert (out / "checkpoints" / "step-2" / "model.json").is_file()  # nothing trained over it, nothing lost
    proc = run_ember("train", "debug", *TINY, "max_steps=4", "model.rope_theta=10000.0", f"output_dir={out}",
                     f"model.n_layers={before}")
    assert proc.returncode == 2 and "rope_theta: checkpoint 500000.0, this run 10000.0" in proc.stderr


@pytest.mark.slow
def test_init_from_an_ember_checkpoint_that_does_not_fit_is_one_line(tmp_path: Path):
    args = build_model_args("llama3", "debug", {"n_layers": 3, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
                                                "vocab_size": 256})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    save_ember_checkpoint(model, "llama3", "debug", args, tmp_path / "ck")
    common = ["data.dataset=synthetic", "seq_len=32", "max_steps=1", f"model.init_from={tmp_path / 'ck'}"]
    for override, message in [("model.n_layers=2", "model.n_layers=2 contradicts model.init_from"),
                              ("model.dim=128", "model.dim=128 contradicts model.init_from"),
                              ("model.family=llama3.2", "model.family=llama3.2 but model.init_from")]:
        proc = run_ember("train", "debug", *common, override, f"output_dir={tmp_path / 'o'}")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    # With nothing restated, the run is the checkpoint's model, weights and all.
    cfg = run_lib.load_config("debug", common + [f"output_dir={tmp_path / 'o'}", "metrics.console=false"])
    trainer = Trainer(cfg)
    assert trainer.spec.args == args
    for name, tensor in model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    trainer.train_loader.close()


@pytest.mark.slow
def test_a_user_error_in_every_rank_prints_once(tmp_path: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *TINY, "model.vocab_size=512", f"data.dataset={empty}",
                     f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: [rank 0, 1] data.dataset '{empty}' yields no documents: it is empty (add text)"], lines
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *TINY, f"data.dataset={tmp_path / 'missing.jsonl'}",
                     f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


@pytest.mark.slow
def test_no_training_from_scratch_over_checkpoints_that_cannot_be_resumed(tmp_path: Path):
    out = tmp_path / "r"
    assert run_ember("train", "debug", *TINY, "max_steps=2", f"output_dir={out}").returncode == 0
    step_dir = out / "checkpoints" / "step-2"
    next(step_dir.glob("*.distcp")).unlink()  # the only checkpoint is now unusable
    proc = run_ember("train", "debug", *TINY, "max_steps=4", f"output_dir={out}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is missing" in proc.stderr and "no checkpoint in" in proc.stderr and "resume=none" in proc.stderr
    assert (step_dir / "model.json").is_file() and not (out / "checkpoints" / "step-4").exists()


def test_starting_over_moves_every_file_of_the_old_run(tmp_path: Path):
    """resume=none: the old run's tracker ids go too (the new run must not log into its W&B/MLflow run), and
    its run.json and report (ember report previous-*/ names its model); the trackers' stores stay."""
    out = tmp_path / "r"
    files = ["metrics.jsonl", "run.json", "config.yaml", "wandb-run-id", "mlflow-run-id", "report.html", "eval.json",
             "checkpoints/step-2/model.json", "tb/events", "config_history/segment-1-step-0.yaml",
             "report/loss.png", "profile/rank0.step3-4.pt.trace.json"]
    stores = ["mlflow.db", "mlartifacts/1/a", "wandb/offline-run-x/run.wandb", "logs/job-1.out"]
    for name in files + stores:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    said: list[str] = []
    previous = archive_previous_run(out, said.append)
    assert previous is not None and previous.parent == out
    assert [name for name in files if (previous / name).read_text() != name] == []
    assert [name for name in files if (out / name).exists()] == []
    assert [name for name in stores if (out / name).read_text() != name] == []
