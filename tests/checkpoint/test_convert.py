"""`ember convert` between HF safetensors, ember DCP checkpoints and torch.save files, and model.init_from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from ember import config as config_lib
from ember.load import load_model, save_ember_checkpoint
from ember.models import build_model_args
from ember.models.llama import Transformer
from ember.train import Trainer


def _model(family: str) -> Transformer:
    args = build_model_args(family, "debug", {"n_layers": 2, "vocab_size": 512, "max_seq_len": 64})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", "convert", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])  # rope scaling and GQA; tied embeddings
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, family: str):
    model = _model(family)
    save_ember_checkpoint(model, family, "debug", model.args, tmp_path / "run" / "checkpoints" / "step-3")
    proc = _convert(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_round_trip_through_every_format(tmp_path: Path):
    model = _model("llama3")
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ember")
    steps = [("ember", "torch.pt", "torch"), ("torch.pt", "ember2", None), ("ember2", "hf", None),
             ("hf", "ember3", None), ("ember3", "hf2", "hf")]
    for src, dst, to in steps:
        proc = _convert(str(tmp_path / src), str(tmp_path / dst), *(["--to", to] if to else []))
        assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        expected = model(tokens)
        for name in ("ember2", "hf", "ember3", "hf2"):
            assert torch.equal(load_model(tmp_path / name)(tokens), expected), name
    assert json.loads((tmp_path / "ember2" / "model.json").read_text())["family"] == "llama3"
    proc = _convert(str(tmp_path / "missing"), str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr == f"error: '{tmp_path / 'missing'}' does not exist\n"
    (tmp_path / "evil.pt").write_bytes(b"not a pickle")
    proc = _convert(str(tmp_path / "evil.pt"), str(tmp_path / "y"))
    assert proc.returncode == 2 and "is not a torch.save file ember can read safely" in proc.stderr


def test_training_starts_from_an_hf_directory(tmp_path: Path):
    model = _model("llama3")
    hf_dir = tmp_path / "hf"
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "ember")
    assert _convert(str(tmp_path / "ember"), str(hf_dir)).returncode == 0
    cfg = config_lib.load("debug", ["data.dataset=synthetic", "model.n_layers=2", "model.vocab_size=512",
                                    "model.max_seq_len=64", "seq_len=16", "max_steps=1", f"model.init_from={hf_dir}",
                                    f"output_dir={tmp_path / 'out'}", "metrics.console=false"])
    trainer = Trainer(cfg)
    for name, tensor in model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    # A contradicting override is refused at config time, naming both values (it used to surface as a
    # shape mismatch once the model was built).
    with pytest.raises(config_lib.ConfigError, match=r"model.vocab_size=1024 contradicts .* \(vocab_size 512\)"):
        config_lib.load("debug", ["data.dataset=synthetic", "model.n_layers=2", "model.vocab_size=1024",
                                  "model.max_seq_len=64", "seq_len=16", f"model.init_from={hf_dir}",
                                  f"output_dir={tmp_path / 'out2'}"])


@pytest.mark.parametrize("meta, message", [
    ({"family": "nope", "flavor": "x", "args": {}}, "names model family 'nope', which ember does not know"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": 64, "bogus": 1}}, "'bogus' is not a hyper-parameter"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": 64}}, "hyper-parameter 'n_layers' is missing"),
    ({"family": "llama3", "flavor": "debug", "args": {"dim": [64]}}, "'dim' = [64] is not a number"),
    ({"flavor": "debug"}, "has no model description"),
])
def test_a_file_with_bad_model_metadata_is_one_line(tmp_path: Path, meta: dict, message: str):
    # Metadata is read from disk: an unknown family or hyper-parameter used to end in a KeyError/TypeError
    # traceback.
    torch.save({"model": {}, "ember": meta}, tmp_path / "odd.pt")
    proc = _convert(str(tmp_path / "odd.pt"), str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    model = _model("llama3")
    good = {"family": "llama3", "flavor": "debug", "args": {**model.args.__dict__}}
    torch.save({"model": {"tok_embeddings.weight": torch.zeros(3)}, "ember": good}, tmp_path / "short.pt")
    proc = _convert(str(tmp_path / "short.pt"), str(tmp_path / "out2"))
    assert proc.returncode == 2 and "its weights do not fit its llama3 description" in proc.stderr, proc.stderr
