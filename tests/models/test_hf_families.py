"""Every family with a Hugging Face form offers the same interface to the code that reads and writes HF directories
(load_hf_model, model.init_from's streaming load_hf_weights, save_hf), and an export of each reads back the same
weights both ways. Phi-3 once lacked what the streaming path asked of it (`skip_hf_key`) and crashed there alone."""

from pathlib import Path

import pytest
import torch

from ember.errors import CheckpointError
from ember.model_io.convert import save_hf
from ember.model_io.hf_directory import load_hf_model
from ember.model_io.load import load_hf_weights
from ember.models import MODELS, build_model_args, glam

# what ember/model_io/hf_directory.py, ember/model_io/load.py and ember/model_io/convert.py call on MODELS[family].hf
INTERFACE = ("args_from_hf_config", "hf_config_from_args", "from_hf_state_dict", "to_hf_state_dict")
HF_FAMILIES = sorted(f for f, spec in MODELS.items() if spec.hf is not glam.hf and "debug" in spec.flavors)
SMALL = {"vocab_size": 256, "n_layers": 6}  # Gemma 3's one global layer in six among them


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_family_module_offers_the_interface(family: str):
    hf = MODELS[family].hf
    assert [name for name in INTERFACE if not callable(getattr(hf, name, None))] == [], family
    shares_its_class = [f for f, spec in MODELS.items() if spec.model_cls is MODELS[family].model_cls]
    if len(shares_its_class) > 1:  # models.family_of asks the hf module which of them a model is
        assert callable(getattr(hf, "family_of", None)), family


def _random_model(family: str) -> torch.nn.Module:
    args = build_model_args(family, "debug", SMALL)
    torch.manual_seed(0)
    model = MODELS[family].model_cls(args)
    with torch.no_grad():  # every tensor drawn apart (the init leaves norms at one, where a swap would go unseen)
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_an_export_reads_back_whole_and_streamed(tmp_path: Path, family: str):
    """save_hf, then load_hf_model (ember convert, eval, generate) and load_hf_weights (model.init_from, tensor by
    tensor into a built model) give the exported weights bit for bit; a family whose experts change layout on load
    is refused by the streaming path with a message naming the way round."""
    model = _random_model(family)
    save_hf(model, model.args, tmp_path)
    want = model.state_dict()
    whole = load_hf_model(tmp_path, "cpu", torch.float32)
    hf = MODELS[family].hf
    # the same model, maybe spelled otherwise
    assert hf.hf_config_from_args(whole.args) == hf.hf_config_from_args(model.args)
    assert whole.state_dict().keys() == want.keys() and all(torch.equal(whole.state_dict()[k], want[k]) for k in want)
    streamed = MODELS[family].model_cls(model.args)
    if getattr(model.args, "n_experts", 0):
        with pytest.raises(CheckpointError, match=r"is not supported yet; convert it first"):
            load_hf_weights(streamed, tmp_path)
        return
    load_hf_weights(streamed, tmp_path)
    got = streamed.state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
