"""`ember convert` between HF safetensors, ember DCP checkpoints and torch.save files, and model.init_from."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from ember import cli, config as config_lib
from ember.errors import CheckpointError
from ember.model_io.convert import convert, save_ember_checkpoint
from ember.model_io.load import load_model
from ember.model_io.model_meta import check_architecture
from ember.models import MODELS, build_model_args
from ember.models.llama import Transformer
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import run_ember, tiny_model


def _model(family: str) -> Transformer:
    args = build_model_args(family, "debug", {"n_layers": 2, "vocab_size": 512, "max_seq_len": 64})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])  # rope scaling and GQA; tied embeddings
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, family: str):
    model = _model(family)
    save_ember_checkpoint(model, family, "debug", model.args, tmp_path / "run" / "checkpoints" / "step-3")
    proc = run_ember("convert", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_round_trip_through_every_format(tmp_path: Path):
    model = _model("llama3")
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ember")
    steps = [("ember", "torch.pt", "torch"), ("torch.pt", "ember2", None), ("ember2", "hf", None),
             ("hf", "ember3", None), ("ember3", "hf2", "hf")]
    for src, dst, to in steps:
        proc = run_ember("convert", str(tmp_path / src), str(tmp_path / dst), *(["--to", to] if to else []))
        assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        expected = model(tokens)
        for name in ("ember2", "hf", "ember3", "hf2"):
            assert torch.equal(load_model(tmp_path / name)(tokens), expected), name
    assert json.loads((tmp_path / "ember2" / "model.json").read_text())["family"] == "llama3"
    proc = run_ember("convert", str(tmp_path / "missing"), str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr == f"error: '{tmp_path / 'missing'}' does not exist\n"
    (tmp_path / "evil.pt").write_bytes(b"not a pickle")
    proc = run_ember("convert", str(tmp_path / "evil.pt"), str(tmp_path / "y"))
    assert proc.returncode == 2 and proc.stderr == (
        f"error: '{tmp_path / 'evil.pt'}' is not a model: a model path is an ember run or checkpoint directory "
        "(model.json, checkpoints/step-N), a HF model directory (config.json) or an `ember convert --to torch` file\n")


@pytest.mark.slow
def test_training_starts_from_an_hf_directory(tmp_path: Path):
    model = _model("llama3")
    hf_dir = tmp_path / "hf"
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ember")
    assert run_ember("convert", str(tmp_path / "ember"), str(hf_dir)).returncode == 0
    cfg = run_lib.load_config("debug", ["data.dataset=synthetic", "model.n_layers=2", "model.vocab_size=512",
                                    "model.max_seq_len=64", "seq_len=16", "max_steps=1", f"model.init_from={hf_dir}",
                                    f"output_dir={tmp_path / 'out'}", "metrics.console=false"])
    trainer = Trainer(cfg)
    for name, tensor in model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    # A contradicting override is refused at config time, naming both values (it used to surface as a
    # shape mismatch once the model was built).
    with pytest.raises(config_lib.ConfigError, match=r"model.vocab_size=1024 contradicts .* \(vocab_size 512\)"):
        run_lib.load_config("debug", ["data.dataset=synthetic", "model.n_layers=2", "model.vocab_size=1024",
                                  "model.max_seq_len=64", "seq_len=16", f"model.init_from={hf_dir}",
                                  f"output_dir={tmp_path / 'out2'}"])


def _full_args() -> dict:
    return dataclasses.asdict(_model("llama3").args)


@pytest.mark.slow
@pytest.mark.parametrize("meta, message", [
    ({"family": "nope", "flavor": "x", "args": {}}, "names model family 'nope', which ember does not know"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": 64, "bogus": 1}}, "'bogus' is not a hyper-parameter"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": 64}}, "hyper-parameter 'n_layers' is missing"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": [64]}}, "'dim' = [64] is not an integer"),
    ({"flavor": "debug"}, "has no model description"),
])
def test_a_file_with_bad_model_metadata_is_one_line(tmp_path: Path, meta: dict, message: str):
    # Metadata is read from disk: an unknown family or hyper-parameter used to end in a KeyError/TypeError
    # traceback. Through the real command line: exit code 2, one line on stderr, no traceback.
    torch.save({"model": {}, "ember": meta}, tmp_path / "odd.pt")
    proc = run_ember("convert", str(tmp_path / "odd.pt"), str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def _convert_in_process(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = cli.main(["convert", *args])  # a traceback would raise out of main(); a user error returns 2
    return code, capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"dim": "64"}, "hyper-parameter 'dim' = '64' is not an integer"),
    ({"dim": True}, "'dim' = True is not an integer"),
    ({"n_layers": 0}, "'n_layers' = 0 must be >= 1"),
    ({"norm_eps": "1e-5"}, "'norm_eps' = '1e-5' is not a number"),
    ({"rope_theta": float("nan")}, "'rope_theta' = nan is not a number"),
    ({"tie_embeddings": 1}, "'tie_embeddings' = 1 is not true or false"),
    ({"n_kv_heads": 2.0}, "'n_kv_heads' = 2.0 is not an integer or null"),
])
def test_a_mistyped_hyper_parameter_is_one_line(tmp_path: Path, capsys, change: dict, message: str):
    meta = {"family": "llama3", "flavor": "debug", "args": {**_full_args(), **change}}
    torch.save({"model": {}, "ember": meta}, tmp_path / "odd.pt")
    code, err = _convert_in_process(capsys, str(tmp_path / "odd.pt"), str(tmp_path / "out"))
    assert code == 2 and err.count("\n") == 1 and message in err and "odd.pt" in err, err


def test_weights_that_do_not_fit_their_description_are_one_line(tmp_path: Path, capsys):
    model = _model("llama3")
    good = {"family": "llama3", "flavor": "debug", "args": _full_args()}
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(3)}, "ember": good}, tmp_path / "short.pt")
    code, err = _convert_in_process(capsys, str(tmp_path / "short.pt"), str(tmp_path / "out"))
    assert code == 2 and "its weights do not fit its llama3 description" in err, err
    torch.save({"model": {}, "ember": {**good, "flavor": 3}}, tmp_path / "flavor.pt")
    code, err = _convert_in_process(capsys, str(tmp_path / "flavor.pt"), str(tmp_path / "out"))
    assert code == 2 and "flavor 3 is not a name" in err, err
    # A checkpoint's model.json read from disk: damaged, or describing other weights than the DCP files hold.
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    (tmp_path / "ck" / "model.json").write_text("{not json")
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert code == 2 and err.count("\n") == 1 and "model.json' is not readable JSON" in err, err
    (tmp_path / "ck" / "model.json").write_text(json.dumps({**good, "args": {**good["args"], "n_layers": 3}}))
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert code == 2 and err.count("\n") == 1 and "its weights do not fit its model.json" in err, err
    assert "layers.2" in err  # the missing tensor is named
    with pytest.raises(CheckpointError, match="'bogus' is not a hyper-parameter"):  # resume reads it the same way
        (tmp_path / "ck" / "model.json").write_text(json.dumps({**good, "args": {**good["args"], "bogus": 1}}))
        check_architecture(tmp_path / "ck", good)


def test_a_family_without_an_hf_format_is_one_line(tmp_path: Path, capsys):
    args = build_model_args("glam", "debug", {"n_layers": 2, "dim": 64, "n_heads": 4, "vocab_size": 256,
                                              "ffn_hidden_dim": 64, "n_experts": 2, "max_seq_len": 64})
    model = MODELS["glam"].model_cls(args)
    model.init_weights()
    save_ember_checkpoint(model, "glam", "debug", args, tmp_path / "ck")
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "hf"))  # ember -> hf by default
    assert code == 2 and err.count("\n") == 1 and "GLaM family has no Hugging Face format" in err, err
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_convert_writes_over_a_non_empty_destination_only_with_overwrite(tmp_path: Path, capsys):
    first, second = _model("llama3"), _model("llama3")
    with torch.no_grad():
        second.output.weight.mul_(2)
    save_ember_checkpoint(first, "llama3", "debug", first.args, tmp_path / "run" / "checkpoints" / "step-1")
    save_ember_checkpoint(second, "llama3", "debug", second.args, tmp_path / "second")
    hf_dir = tmp_path / "hf"
    assert _convert_in_process(capsys, str(tmp_path / "run"), str(hf_dir)) == (0, "")
    (hf_dir / "model.safetensors.index.json").write_text("{}")  # as left by an earlier sharded export
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    code, err = _convert_in_process(capsys, str(tmp_path / "second"), str(hf_dir))
    assert (code, err) == (2, f"error: '{hf_dir}' is not empty; give --overwrite to replace what it holds, or write "
                              "to a new directory\n")
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before  # untouched
    assert _convert_in_process(capsys, str(tmp_path / "second"), str(hf_dir), "--overwrite") == (0, "")
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "model.safetensors"]  # nothing stale left
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(hf_dir)(tokens), second(tokens))
    # --overwrite never destroys what the conversion reads: the source itself, or a directory holding it
    step = tmp_path / "run" / "checkpoints" / "step-1"
    for dst in (step, tmp_path / "run"):
        code, err = _convert_in_process(capsys, str(step), str(dst), "--overwrite")
        assert (code, err) == (2, f"error: '{dst}' holds {step}, which converting '{step}' reads; --overwrite would "
                                  "destroy it: write to another directory\n")
    assert load_model(step) is not None and (tmp_path / "run" / "checkpoints").is_dir()
    # A file destination too: an earlier --to torch export is replaced with --overwrite
    pt = tmp_path / "model.pt"
    assert _convert_in_process(capsys, str(tmp_path / "second"), str(pt), "--to", "torch") == (0, "")
    before = pt.read_bytes()
    code, err = _convert_in_process(capsys, str(step), str(pt), "--to", "torch")
    assert (code, err) == (2, f"error: '{pt}' exists; give --overwrite to replace it, or write to a new file\n")
    assert pt.read_bytes() == before
    assert _convert_in_process(capsys, str(step), str(pt), "--to", "torch", "--overwrite") == (0, "")
    with torch.no_grad():
        assert torch.equal(load_model(pt)(tokens), first(tokens))
    assert not list(tmp_path.glob(".*convert-*"))  # no staging left behind


def test_a_destination_of_another_kind_than_the_format_writes_is_refused(tmp_path: Path, capsys):
    # --to torch writes one file, the other formats a directory; --overwrite replaced a file with a directory, or
    # wrote a torch pickle over an HF directory's weights (which then failed to load).
    model = _model("llama3")
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    hf = tmp_path / "hf"
    assert _convert_in_process(capsys, str(tmp_path / "ck"), str(hf)) == (0, "")
    weights = hf / "model.safetensors"
    before = weights.read_bytes()
    for overwrite in ([], ["--overwrite"]):
        code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(weights), "--to", "hf", *overwrite)
        assert (code, err) == (2, f"error: '{weights}' is a file, but --to hf writes a directory: give a new path\n")
        code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(hf), "--to", "torch", *overwrite)
        assert (code, err) == (2, f"error: '{hf}' is a directory, but --to torch writes one file: give a new path such "
                                  f"as '{hf / 'model.pt'}'\n")
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(weights), "--to", "torch", "--overwrite")
    assert (code, err) == (2, f"error: '{weights}' is not a file `ember convert --to torch` wrote (it is part of the "
                              f"Hugging Face directory '{hf}'); --overwrite replaces only such a file: write to a new "
                              "file\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(notes), "--to", "torch", "--overwrite")
    assert (code, err) == (2, f"error: '{notes}' is not a file `ember convert --to torch` wrote; --overwrite replaces "
                              "only such a file: write to a new file\n")
    assert weights.read_bytes() == before and notes.read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    code, err = _convert_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "empty"), "--to", "torch")
    assert code == 2 and "is a directory, but --to torch writes one file" in err and (tmp_path / "empty").is_dir()


def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path: Path, capsys):
    model = _model("llama3")
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    hf = tmp_path / "hf"
    convert(tmp_path / "ck", hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    code, err = _convert_in_process(capsys, str(hf), str(tmp_path / "out"))
    assert (code, err) == (2, f"error: '{weights}' is not a readable safetensors file (Error while deserializing "
                              "header: incomplete metadata, file not fully covered): it is damaged or another format "
                              "was written over it; export or copy it again\n")
    convert(tmp_path / "ck", tmp_path / "model.pt", "torch")
    weights.write_bytes((tmp_path / "model.pt").read_bytes())  # a torch pickle where the safetensors were
    code, err = _convert_in_process(capsys, str(hf), str(tmp_path / "out"))
    assert (code, err) == (2, f"error: '{weights}' is not a readable safetensors file (Error while deserializing "
                              "header: header too large): it is damaged or another format was written over it; "
                              "export or copy it again\n")
    assert not (tmp_path / "out").exists()


def test_merge_applies_to_a_lora_run_or_a_peft_adapter_only(tmp_path: Path, capsys):
    model = _model("llama3")
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    convert(tmp_path / "ck", tmp_path / "hf")
    convert(tmp_path / "ck", tmp_path / "model.pt", "torch")
    for src, what in (("ck", "an ember checkpoint of a whole model (trained without lora.rank)"),
                      ("hf", "a Hugging Face directory"), ("model.pt", "a torch.save file")):
        code, err = _convert_in_process(capsys, str(tmp_path / src), str(tmp_path / "out"), "--merge")
        assert (code, err) == (2, f"error: --merge folds a LoRA run's or a peft adapter's adapters into the base; "
                                  f"'{tmp_path / src}' is {what}, with none to fold: drop --merge\n")
    assert not (tmp_path / "out").exists()


LORA_RUN = ["data.dataset=synthetic", *tiny_model(2), "model.vocab_size=512", "seq_len=32", "global_batch_size=8",
            "micro_batch_size=8", "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false",
            "optim.lr=1e-2", "max_steps=2"]


@pytest.mark.slow
def test_a_lora_run_to_ember_is_its_merged_model_with_its_tokenizer(tmp_path: Path, capsys):
    # docs/fine-tuning.md: --merge is implied by --to hf|ember|torch for a LoRA run; --to ember was refused as
    # "already in ember format", with --merge too.
    Trainer(run_lib.load_config("debug", LORA_RUN + [f"output_dir={tmp_path / 'base'}"])).train()
    Trainer(run_lib.load_config("debug", LORA_RUN + ["lora.rank=4", "lora.alpha=8",
                                                     f"model.init_from={tmp_path / 'base'}",
                                                     f"output_dir={tmp_path / 'lora'}"])).train()
    step = tmp_path / "lora" / "checkpoints" / "step-2"
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_model(tmp_path / "lora")(tokens)
    for src, dst, flags in (("lora", "merged", ["--to", "ember"]), ("lora", "merged2", ["--to", "ember", "--merge"]),
                            (str(step), "merged3", ["--to", "ember"])):
        assert _convert_in_process(capsys, str(tmp_path / src), str(tmp_path / dst), *flags) == (0, "")
        meta = json.loads((tmp_path / dst / "model.json").read_text())
        assert "lora" not in meta and "base" not in meta  # a plain checkpoint: it needs no base
        with torch.no_grad():
            torch.testing.assert_close(load_model(tmp_path / dst)(tokens), expected, rtol=1e-5, atol=1e-5)
    from ember.generate import tokenizer_for

    merged_tokenizer, run_tokenizer = tokenizer_for(tmp_path / "merged"), tokenizer_for(tmp_path / "lora")
    assert merged_tokenizer.encode("def main(") == run_tokenizer.encode("def main(")
    code, err = _convert_in_process(capsys, str(tmp_path / "base"), str(tmp_path / "again"), "--to", "ember")
    assert (code, err) == (2, f"error: '{tmp_path / 'base'}' is already in ember format\n")


def test_hf_to_ember_keeps_the_tokenizer_beside_the_checkpoint(tmp_path: Path, capsys):
    # `ember eval dcp` / `ember generate dcp` after `ember convert hf dcp` said "no tokenizer is known".
    import tokenizers

    model = _model("llama3")
    hf = tmp_path / "hf"
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    convert(tmp_path / "ck", hf)
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 512)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert _convert_in_process(capsys, str(hf), str(tmp_path / "dcp")) == (0, "")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "dcp" / name).read_bytes() == (hf / name).read_bytes()
    assert cli.main(["generate", str(tmp_path / "dcp"), "--prompt", "w5 w9", "--max-new-tokens", "3", "--json"]) == 0
    from_dcp = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", str(hf), "--prompt", "w5 w9", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_dcp and len(from_dcp["token_ids"]) == 3


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exported_weights_are_readable_like_the_other_files(tmp_path: Path, umask: int, mode: int):
    # safetensors creates its file 0600, so the weights of a shared model directory were unreadable beside
    # its 0644 config.json
    model = _model("llama3")
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ck")
    old = os.umask(umask)
    try:
        convert(tmp_path / "ck", tmp_path / "hf", "hf")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": mode, "model.safetensors": mode}


def test_a_destination_that_cannot_be_created_is_one_line(tmp_path):
    from ember.model_io.convert import check_destination

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for dst, says in ((a_file / "out", "is a file"), (Path("/proc/ember-out"), "cannot be created in '/proc'")):
        with pytest.raises(CheckpointError, match=says):
            check_destination(tmp_path, dst, overwrite=False, to="hf")
    check_destination(tmp_path, tmp_path / "new" / "deeper", overwrite=False, to="hf")  # creatable: no error
    assert not list(tmp_path.glob(".ember-convert-probe-*")) and not (tmp_path / "new").exists()
