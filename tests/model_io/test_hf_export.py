"""An export to Hugging Face carries what transformers' generate needs to stop: config.json's bos/eos/pad_token_id and
generation_config.json, from the HF directory the model came from (through an ember checkpoint too), or from the
run's tokenizer; and the config fields no ember hyper-parameter holds (Qwen3-MoE's router_aux_loss_coef)."""

import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
import yaml

from ember.model_io.convert import convert, save_ember_checkpoint
from ember.model_io.hf_export import GENERATION_CONFIG, SOURCE_CONFIG
from ember.models import MODELS, build_model_args
from tests.models.hf_parity import random_hf_model

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=128, max_position_embeddings=64)


def _llama(directory: Path) -> None:
    config = transformers.LlamaConfig(**TEXT, bos_token_id=5, eos_token_id=[6, 7], pad_token_id=None)
    random_hf_model(transformers.LlamaForCausalLM, config, directory)


def _qwen3_moe(directory: Path) -> None:
    config = transformers.Qwen3MoeConfig(**TEXT, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                         router_aux_loss_coef=0.02, bos_token_id=3, eos_token_id=4, pad_token_id=4)
    random_hf_model(transformers.Qwen3MoeForCausalLM, config, directory)


def _gemma3_multimodal(directory: Path) -> None:
    """As the hub's gemma-3-4b-it: the text model's ids left at Gemma3TextConfig's defaults (bos 2, pad 0, absent from
    text_config), its EOS list on the top level."""
    text = transformers.Gemma3TextConfig(**TEXT, sliding_window=8, query_pre_attn_scalar=8)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    random_hf_model(transformers.Gemma3ForConditionalGeneration, config, directory)
    written = json.loads((directory / "config.json").read_text())
    text_config = {k: v for k, v in written["text_config"].items() if k not in IDS}
    (directory / "config.json").write_text(json.dumps({**written, "text_config": text_config,
                                                       "eos_token_id": [1, 106]}))


SOURCES = {"llama": _llama, "qwen3_moe": _qwen3_moe, "gemma3": _gemma3_multimodal}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_hf_to_ember_to_hf_keeps_the_ids_and_generation_config(tmp_path: Path, kind: str):
    SOURCES[kind](tmp_path / "hf")
    generation = {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "do_sample": True, "top_k": 64,
                  "top_p": 0.95}  # a release's own sampling defaults, not what config.json would derive
    (tmp_path / "hf" / GENERATION_CONFIG).write_text(json.dumps(generation))
    convert(tmp_path / "hf", tmp_path / "ember")
    assert (tmp_path / "ember" / SOURCE_CONFIG).is_file()
    convert(tmp_path / "ember", tmp_path / "export")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    stated = {**source, **source.get("text_config", {})}
    assert {k: exported.get(k, "unset") for k in IDS} == {k: stated.get(k, "unset") for k in IDS}
    assert (tmp_path / "export" / GENERATION_CONFIG).read_bytes() == (tmp_path / "hf" / GENERATION_CONFIG).read_bytes()
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    if kind == "gemma3":  # the ids the text model had: bos and pad its class's defaults, the EOS list of the release
        assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (2, [1, 106], 0)
    if kind == "qwen3_moe":
        # num_experts: the hub's name and transformers 4.x's; transformers 5 reads it (and writes num_local_experts)
        assert exported["num_experts"] == 4 and "num_local_experts" not in exported
        assert (loaded.num_experts, loaded.router_aux_loss_coef) == (4, 0.02)


def test_a_run_exports_its_tokenizers_ids(tmp_path: Path):
    """A model from no HF directory (an ember run): config.json and generation_config.json name the ids of the
    tokenizer the run trained with, which `ember convert` copies beside the export."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "a": 4},
                                                           unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    run = tmp_path / "run"
    args = build_model_args("llama3", "debug",
                            {"n_layers": 1, "vocab_size": 64, "dim": 32, "n_heads": 2, "n_kv_heads": 2})
    torch.manual_seed(0)
    model = MODELS["llama3"].model_cls(args)
    save_ember_checkpoint(model, "llama3", "debug", args, run / "checkpoints" / "step-1")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": str(tmp_path / "tok" / "tokenizer.json")}}))
    convert(run, tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {k: exported[k] for k in IDS} == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "export").eos_token_id == 2
