"""A LoRA run records its base's fingerprint (each weight file's size and sha256) and refuses a base that has
changed since, when it is loaded (eval, generate, convert, model.init_from) or resumed: its adapters on other
weights would give other logits without a word. The digests are cached by each file's identity and times."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from ember.errors import CheckpointError, ConfigError, EmberError
from ember.finetune import base_fingerprint
from ember.finetune.base_fingerprint import differences, fingerprint
from ember.model_io.convert import convert, save_hf
from ember.model_io.load import load_model, load_weights
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import tiny_model

SHAPE = ["data.dataset=synthetic", *tiny_model(2), "model.vocab_size=512", "seq_len=32", "global_batch_size=8",
         "micro_batch_size=8", "logging_steps=1", "eval_batches=1", "schedule.warmup_steps=0", "metrics.console=false",
         "metrics.tensorboard=false", "optim.lr=1e-2"]
LORA = ["lora.rank=4", "lora.alpha=8", "checkpoint.interval=2"]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "run"
    Trainer(run_lib.load_config("debug", SHAPE + ["max_steps=2", f"output_dir={out}"])).train()
    return out / "checkpoints" / "step-2"


def _lora(out: Path, base: Path, steps: int) -> Trainer:
    return Trainer(run_lib.load_config("debug", SHAPE + LORA + [f"max_steps={steps}", f"model.init_from={base}",
                                                            f"output_dir={out}"]))


def _overwrite_one_weight(base_ckpt: Path, base_hf: Path) -> None:
    """The base re-exported with one weight of one tensor changed by 1e-3: what a sampled digest could miss."""
    model = load_model(base_ckpt)
    config = (base_hf / "config.json").read_bytes()  # convert's, with the run's token ids: only the weights change
    with torch.no_grad():
        model.output.weight[0, 0] += 1e-3
    save_hf(model, model.args, base_hf)
    (base_hf / "config.json").write_bytes(config)


@pytest.mark.slow
def test_the_run_records_each_base_file_with_its_size_and_sha256(base_ckpt: Path, tmp_path: Path):
    base = tmp_path / "base-hf"
    convert(base_ckpt, base, "hf")
    _lora(tmp_path / "lora", base, 2).train()
    meta = json.loads((tmp_path / "lora" / "checkpoints" / "step-2" / "model.json").read_text())
    assert meta["base"] == str(base.resolve())
    expected = {name: {"bytes": (base / name).stat().st_size,
                       "sha256": hashlib.sha256((base / name).read_bytes()).hexdigest()}
                for name in ("config.json", "model.safetensors")}  # not the tokenizer: it holds no weight
    assert meta["base_fingerprint"] == expected
    # A run directory as the base: its newest complete step's files, named from the run directory
    run_base = fingerprint(base_ckpt.parent.parent)
    assert sorted(run_base) == ["checkpoints/step-2/.metadata", "checkpoints/step-2/__0_0.distcp",
                                "checkpoints/step-2/model.json"]
    # A peft adapter as the base: its files and its own base's (folded in on load); a torch file: by its name, so
    # a copy elsewhere fingerprints the same
    convert(tmp_path / "lora", tmp_path / "adapter", "peft")
    assert sorted(fingerprint(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors",
                                                         "base/config.json", "base/model.safetensors"]
    convert(base_ckpt, tmp_path / "model.pt", "torch")
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "model.pt").write_bytes((tmp_path / "model.pt").read_bytes())
    assert fingerprint(tmp_path / "copy" / "model.pt") == fingerprint(tmp_path / "model.pt")
    assert list(fingerprint(tmp_path / "model.pt")) == ["model.pt"]
    # ... and a base run trained further since is told apart, by name
    moved = {name.replace("step-2", "step-4"): value for name, value in run_base.items()}
    assert differences(run_base, moved) == ("checkpoints/step-2/.metadata, checkpoints/step-2/__0_0.distcp, "
                                            "checkpoints/step-2/model.json gone; checkpoints/step-4/.metadata, "
                                            "checkpoints/step-4/__0_0.distcp, checkpoints/step-4/model.json added")


@pytest.mark.slow
def test_a_changed_base_is_refused_by_every_load_and_by_resume(base_ckpt: Path, tmp_path: Path):
    base, run = tmp_path / "base-hf", tmp_path / "lora"
    convert(base_ckpt, base, "hf")
    _lora(run, base, 4).train()
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = load_model(run)(tokens)
    with pytest.raises(CheckpointError) as err:  # merging the run onto its own base would destroy what it reads
        convert(run, base, "hf", overwrite=True)
    assert str(err.value) == (f"'{base}' holds {base.resolve()}, which converting '{run}' reads; --overwrite would "
                              "destroy it: write to another directory")
    _overwrite_one_weight(base_ckpt, base)
    step = run / "checkpoints" / "step-4"
    message = (f"'{step}' holds LoRA adapters trained on the base '{base.resolve()}', which has changed since "
               '(model.safetensors changed); put that base back there, or point "base" in its model.json at a copy '
               "of it: adapters fit only the weights they were trained on")
    with pytest.raises(CheckpointError) as err:  # ember eval, ember generate, convert --merge
        load_model(run)
    assert str(err.value) == message
    with pytest.raises(CheckpointError) as err:
        convert(run, tmp_path / "adapter", "peft")
    assert str(err.value) == message and not (tmp_path / "adapter").exists()
    with pytest.raises(CheckpointError) as err:  # model.init_from of the LoRA run
        load_weights(load_model(base_ckpt), run)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # resume=auto of the run, on the base overwritten
        _lora(run, base, 6)
    assert str(err.value) == (
        f"resume: checkpoint {step} was trained with another base than model.init_from={base.resolve()} holds now "
        "(model.safetensors changed); resume on the weights it was trained with, or start over on these with "
        "resume=none (the old run is moved aside)")
    # The fix the message names: the original base, elsewhere, with "base" pointed at it
    original = tmp_path / "original-hf"
    convert(base_ckpt, original, "hf")
    meta = json.loads((step / "model.json").read_text())
    (step / "model.json").write_text(json.dumps({**meta, "base": str(original)}))
    with torch.no_grad():
        assert torch.equal(load_model(step)(tokens), before)


def test_a_cached_digest_serves_only_the_same_unchanged_file(tmp_path: Path, monkeypatch):
    file = tmp_path / "model" / "model.safetensors"
    file.parent.mkdir()
    file.write_bytes(b"a" * 64)
    old = 1_000_000_000_000_000_000  # 2001: timestamps long settled
    os.utime(file, ns=(old, old))
    real = hashlib.sha256(b"a" * 64).hexdigest()
    cache = tmp_path / "cache" / "file_digests.json"
    # A file whose ctime is this second is not cached: a write in the same clock tick would not show in its times
    assert fingerprint(file.parent) == {"model.safetensors": {"bytes": 64, "sha256": real}} and not cache.exists()
    stamp = base_fingerprint._stamp(file)
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(json.dumps({"files": {str(file.resolve()): [stamp, "cached"]}}))
    assert fingerprint(file.parent)["model.safetensors"]["sha256"] == "cached"  # the same file: not read again
    stale = [*stamp[:4], stamp[4] - 1]  # an overwrite in place that kept size and mtime still moves ctime
    cache.write_text(json.dumps({"files": {str(file.resolve()): [stale, "cached"]}}))
    assert fingerprint(file.parent)["model.safetensors"]["sha256"] == real


@pytest.mark.slow
def test_a_peft_export_is_readable_like_the_runs_other_files(base_ckpt: Path, tmp_path: Path):
    _lora(tmp_path / "lora", base_ckpt, 2).train()
    umask = os.umask(0o022)
    try:
        convert(tmp_path / "lora", tmp_path / "adapter", "peft")
    finally:
        os.umask(umask)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_a_full_dpo_run_refuses_to_resume_on_a_changed_reference(base_ckpt: Path, tmp_path: Path):
    """task=dpo without LoRA rebuilds its frozen reference from model.init_from on resume (the checkpoint holds
    only the policy): the reference's weights are recorded and checked like a LoRA base's."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": " yes", "rejected": " no"}) + "\n"
                             for i in range(32)))
    base, run = tmp_path / "base-hf", tmp_path / "dpo"
    convert(base_ckpt, base, "hf")
    dpo = lambda steps: Trainer(run_lib.load_config(  # noqa: E731
        "debug", SHAPE + ["task=dpo", f"data.dataset={pairs}", "checkpoint.interval=2", f"max_steps={steps}",
                          f"model.init_from={base}", f"output_dir={run}"]))
    dpo(2).train()
    meta = json.loads((run / "checkpoints" / "step-2" / "model.json").read_text())
    assert meta["reference"] == str(base.resolve()) and meta["reference_fingerprint"] == fingerprint(base)
    _overwrite_one_weight(base_ckpt, base)
    with pytest.raises(ConfigError) as err:
        dpo(4)
    assert str(err.value) == (
        f"resume: checkpoint {run / 'checkpoints' / 'step-2'} was trained with another DPO reference than "
        f"model.init_from={base.resolve()} holds now (model.safetensors changed); resume on the weights it was "
        "trained with, or start over on these with resume=none (the old run is moved aside)")


@pytest.mark.slow
def test_resuming_on_a_base_that_lost_its_weights_names_it_as_the_runs_base(base_ckpt: Path, tmp_path: Path):
    base, run = tmp_path / "base-hf", tmp_path / "lora"
    convert(base_ckpt, base, "hf")
    _lora(run, base, 2).train()
    (base / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as err:  # resume=auto: the checkpoint's base is model.init_from
        _lora(run, base, 4)
    assert str(err.value) == (
        f"resume: checkpoint {run / 'checkpoints' / 'step-2'} was trained on the base model.init_from="
        f"{base.resolve()}, which cannot be loaded now (model.safetensors gone); put the base it was trained on "
        "back there, or start over on other weights with resume=none (the old run is moved aside)")
    with pytest.raises(EmberError) as err:  # starting over: no checkpoint to name, the loader's own line
        Trainer(run_lib.load_config("debug", SHAPE + LORA + ["max_steps=2", f"model.init_from={base}", "resume=none",
                                                         f"output_dir={tmp_path / 'other'}"]))
    assert str(err.value) == f"'{base}' has no model.safetensors or model.safetensors.index.json"
