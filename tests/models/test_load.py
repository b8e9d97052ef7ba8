"""load_model on ember checkpoints, and its one-line errors for paths that hold no model."""

import json
import zipfile
from pathlib import Path

import pytest
import torch

from ember.errors import CheckpointError
from ember.model_io.convert import save_ember_checkpoint
from ember.model_io.load import load_model
from ember.models import build_model_args
from ember.models.llama import Transformer, hf


def _model(family: str, seed: int) -> Transformer:
    args = build_model_args(family, "debug", {"n_layers": 2, "vocab_size": 512, "max_seq_len": 64})
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])  # untied, tied
def test_ember_checkpoint_round_trip(tmp_path: Path, family):
    model = _model(family, seed=0)
    step_dir = tmp_path / "run" / "checkpoints" / "step-7"
    save_ember_checkpoint(model, family, "debug", model.args, step_dir)
    assert json.loads((step_dir / "model.json").read_text())["family"] == family
    assert not step_dir.with_name("step-7.tmp").exists()
    loaded = load_model(step_dir)
    assert not loaded.training and loaded.args == model.args
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert (loaded.output.weight is loaded.tok_embeddings.weight) == (family == "llama3.2")


def test_run_directory_loads_its_newest_complete_step(tmp_path: Path):
    run = tmp_path / "run"
    old, new = _model("llama3", seed=0), _model("llama3", seed=1)
    save_ember_checkpoint(old, "llama3", "debug", old.args, run / "checkpoints" / "step-9")
    save_ember_checkpoint(new, "llama3", "debug", new.args, run / "checkpoints" / "step-10")  # 10 > 9, not "1" < "9"
    (run / "checkpoints" / "step-11.tmp").mkdir()  # an interrupted save is not a checkpoint
    (run / "checkpoints" / "step-12").mkdir()  # nor is a step without model.json
    loaded = load_model(run)
    assert torch.equal(loaded.layers["0"].attention.wq.weight, new.layers["0"].attention.wq.weight)


def test_saving_over_a_step_replaces_it(tmp_path: Path):
    step_dir = tmp_path / "step-1"
    for seed in (0, 1):
        model = _model("llama3", seed)
        save_ember_checkpoint(model, "llama3", "debug", model.args, step_dir)
    assert torch.equal(load_model(step_dir).norm.weight, model.norm.weight)
    assert torch.equal(load_model(step_dir).output.weight, model.output.weight)


def test_ember_checkpoint_loads_in_bf16(tmp_path: Path):
    model = _model("llama3", seed=0)
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "step-1")
    loaded = load_model(tmp_path / "step-1", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16} and loaded.rope_cos.dtype == torch.float32
    assert torch.equal(loaded.output.weight, model.output.weight.bfloat16())


def test_missing_and_garbage_paths(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"^'.*nope' does not exist \(expected an ember run"):
        load_model(tmp_path / "nope")
    # A file that is no torch.save archive (data given where the model goes): what a model path is, not torch's
    # message about mmap and _use_new_zipfile_serialization
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "data.jsonl")
    assert str(err.value) == (f"'{tmp_path / 'data.jsonl'}' is not a model: a model path is an ember run or checkpoint "
                              "directory (model.json, checkpoints/step-N), a HF model directory (config.json) or an "
                              "`ember convert --to torch` file")
    with zipfile.ZipFile(tmp_path / "weights.pt", "w") as archive:  # an archive, but not torch.save's
        archive.writestr("x", "y")
    with pytest.raises(CheckpointError, match="weights.pt' is not a torch.save file ember can read safely"):
        load_model(tmp_path / "weights.pt")
    with pytest.raises(FileNotFoundError, match="holds no model"):
        load_model(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="checkpoints' holds no complete checkpoint"):
        load_model(tmp_path)


def test_hf_directory_errors(tmp_path: Path):
    config = tmp_path / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="config.json' is not readable JSON"):
        load_model(tmp_path)
    config.write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match=r"config.json' describes model_type 'bert'; ember loads llama, mixtral, gpt2, "
                                         r"qwen2, qwen3, qwen3_moe, mistral, phi3, gemma3_text, gemma2, deepseek_v3, "
                                         r"deepseek_v2, llama4_text, llama4, gemma3 \(LlamaForCausalLM, "
                                         r"MixtralForCausalLM, GPT2LMHeadModel, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                         r"Qwen3MoeForCausalLM, MistralForCausalLM, Phi3ForCausalLM, "
                                         r"Gemma3ForCausalLM, Gemma2ForCausalLM, DeepseekV3ForCausalLM, "
                                         r"DeepseekV2ForCausalLM, Llama4ForCausalLM, Llama4ForConditionalGeneration, "
                                         r"Gemma3ForConditionalGeneration\) models"):
        load_model(tmp_path)
    llama = hf.hf_config_from_args(build_model_args("llama3", "debug"))
    config.write_text(json.dumps({**llama, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        load_model(tmp_path)
    config.write_text(json.dumps(llama))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80")  # a pickle: refused, never opened
    with pytest.raises(FileNotFoundError,
                       match="no model.safetensors.*pytorch_model.bin, which ember does not unpickle"):
        load_model(tmp_path)


def test_hf_weights_that_do_not_fit_the_config(tmp_path: Path):
    from safetensors.torch import save_file

    args = build_model_args("llama3", "debug", {"n_layers": 1, "vocab_size": 64, "max_seq_len": 32})
    state = hf.to_hf_state_dict(Transformer(args).state_dict(), args)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_from_args(args)))
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the weights do not fit config.json: .*Missing key\(s\).*norm.weight"):
        load_model(tmp_path)
    save_file({**state, "model.layers.0.self_attn.q_norm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm.weight' is not a weight of LlamaForCausalLM"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-100], "Error while deserializing header: incomplete metadata, file not fully covered"),
    (lambda data: b"PK\x03\x04" + data, "Error while deserializing header: header too large"),  # another format
])
def test_a_damaged_safetensors_file_is_one_line_for_every_reader(tmp_path: Path, damage, reason: str):
    # load_model (ember eval, generate, convert) and load_weights (model.init_from, a sharded ember eval) raised
    # safetensors' own SafetensorError, a traceback
    from safetensors.torch import save_file

    from ember.model_io.load import load_weights

    args = build_model_args("llama3", "debug", {"n_layers": 1, "vocab_size": 64, "max_seq_len": 32})
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config_from_args(args)))
    weights = tmp_path / "model.safetensors"
    save_file(hf.to_hf_state_dict(Transformer(args).state_dict(), args), str(weights))
    weights.write_bytes(damage(weights.read_bytes()))
    message = (f"'{weights}' is not a readable safetensors file ({reason}): it is damaged or another format was "
               "written over it; export or copy it again")
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    assert str(err.value) == message
    with pytest.raises(CheckpointError) as err:
        load_weights(Transformer(args), tmp_path)
    assert str(err.value) == message


def test_the_file_of_convert_to_torch_loads(tmp_path: Path):
    # `ember convert --to torch` writes one file; load_model used to refuse it as "a file".
    from ember.model_io.convert import convert, save_ember_checkpoint

    args = build_model_args("llama3", "debug", {"n_layers": 1, "vocab_size": 256, "max_seq_len": 32})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    save_ember_checkpoint(model, "llama3", "debug", args, tmp_path / "ck")
    convert(tmp_path / "ck", tmp_path / "model.pt", "torch")
    tokens = torch.randint(0, 256, (1, 8))
    loaded = load_model(tmp_path / "model.pt")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model.eval()(tokens))
    half = load_model(tmp_path / "model.pt", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.rope_cos.dtype == torch.float32


def test_each_path_is_detected_once_as_its_format(tmp_path: Path):
    # ember/model_io/sources.py's registry: every entry resolves, and each kind of path is the format its questions go
    # to (the fine-tuning formats are tested on real adapters in tests/finetune/).
    from ember.model_io.convert import convert, save_hf
    from ember.model_io.sources import FORMATS, find_format, formats, is_added_key

    assert len(formats()) == len(FORMATS)
    assert is_added_key("layers.0.attention.wq.lora_A.weight") and not is_added_key("layers.0.attention.wq.weight")
    model = _model("llama3", seed=0)
    save_ember_checkpoint(model, "llama3", "debug", model.args, tmp_path / "run" / "checkpoints" / "step-2")
    convert(tmp_path / "run", tmp_path / "model.pt", "torch")
    save_hf(model, model.args, tmp_path / "hf")
    for path, name in [(tmp_path / "run", "ember checkpoint"), (tmp_path / "run" / "checkpoints" / "step-2",
                       "ember checkpoint"), (tmp_path / "model.pt", "ember convert --to torch file"),
                       (tmp_path / "hf", "Hugging Face directory")]:
        fmt = find_format(path)
        assert fmt is not None and fmt.name == name, path
        args = fmt.architecture(path).args  # HF's config.json keeps the sizes, not multiple_of
        assert (args.dim, args.n_layers, args.vocab_size) == (model.args.dim, 2, 512), path
    assert find_format(tmp_path) is None
