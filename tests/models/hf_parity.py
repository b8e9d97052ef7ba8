"""The parity checks every family with a Hugging Face form passes against transformers' own class:
logits equal, every gradient close, greedy generation equal token for token, and HF -> ember -> HF
bit-exact. Plain functions, shared by tests/models/test_<family>.py."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from ember.generate import generate
from ember.model_io.convert import save_hf
from ember.model_io.load import load_model
from ember.models import MODELS
from tests.helpers import IdTokenizer


def random_hf_model(model_cls: type, config: transformers.PretrainedConfig, directory: Path, seed: int = 0):
    """transformers' model with weights drawn at a visible size (its init leaves norms at one and biases at
    zero, where a swapped or dropped one would go unseen), saved to `directory`."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    return model


def assert_logits_and_gradients_equal(hf_model, directory: Path, family: str, seq: int = 24) -> torch.nn.Module:
    """Loads `directory` as ember's `family` model; its logits equal transformers' (fp32, 1e-4) and the gradient
    of a cross-entropy loss on every parameter is close to transformers', mapped onto ember's names."""
    ours = load_model(directory)
    assert type(ours) is MODELS[family].model_cls
    vocab = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ours.train(), hf_model.train()  # no dropout in either; train mode so MoE bookkeeping runs as in training
    expected = hf_model(inputs).logits
    got = ours(inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    F.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), targets.flatten()).backward()
    hf_grads = {name: p.grad for name, p in hf_model.named_parameters() if p.grad is not None}
    expected_grads = MODELS[family].hf.from_hf_state_dict(hf_grads, ours.args)
    got_grads = {name: p.grad for name, p in ours.named_parameters()}
    assert set(got_grads) <= set(expected_grads) and all(g is not None for g in got_grads.values())
    for name, grad in got_grads.items():
        # fp32 sums in another order: elements near zero are compared at the scale of the tensor's largest
        expected = expected_grads[name]
        torch.testing.assert_close(grad, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()) + 1e-7, msg=name)
    hf_model.zero_grad(), ours.zero_grad()
    return ours.eval()


def assert_round_trip_bit_exact(hf_model, ours: torch.nn.Module, directory: Path) -> None:
    """ember's export loads in transformers as the very weights ember imported: every tensor bit-equal."""
    save_hf(ours, ours.args, directory)
    reloaded = type(hf_model).from_pretrained(directory, torch_dtype=torch.float32)
    want, got = hf_model.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def assert_greedy_equal(hf_model, ours: torch.nn.Module, prompt_len: int = 10, new_tokens: int = 20) -> None:
    """Greedy decoding with ember's KV cache equals transformers' generate(do_sample=False) token for token."""
    prompt = torch.randint(2, hf_model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    expected = hf_model.eval().generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
    (result,) = generate(ours, IdTokenizer(), [prompt[0].tolist()], max_new_tokens=new_tokens, stop_at_eos=False)
    assert result.token_ids == expected


def assert_parity(model_cls: type, config: transformers.PretrainedConfig, tmp_path: Path,
                  family: str) -> torch.nn.Module:
    """Every check above on one small random config; returns ember's model."""
    hf_model = random_hf_model(model_cls, config, tmp_path / "hf")
    ours = assert_logits_and_gradients_equal(hf_model, tmp_path / "hf", family)
    assert_round_trip_bit_exact(hf_model, ours, tmp_path / "export")
    assert_greedy_equal(hf_model, ours)
    return ours


def assert_counts_equal_transformers(family: str) -> None:
    """Every published flavor (not debug) has the parameter count of transformers' own model on its exported
    config, built on the meta device."""
    spec = MODELS[family]
    for name, args in spec.flavors.items():
        config = dict(spec.hf.hf_config_from_args(args))
        config.pop("architectures")
        hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device("meta"):
            theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
            ours = sum(p.numel() for p in spec.model_cls(args).parameters())  # a tied matrix once, as theirs
        assert ours == theirs, (family, name)
