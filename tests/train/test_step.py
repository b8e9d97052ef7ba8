"""The step's fused output loss (the projection and the cross-entropy in row chunks) gives the unfused
step's loss and gradients, for a tied, soft-capped family and a plain one, in fp32 and under bf16 autocast."""

import pytest
import torch

from ember.constants import IGNORE_INDEX
from ember.models import MODELS, build_model_args
from ember.train.step import ForwardBackward


def _losses_and_grads(family: str, fused: bool, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    args = build_model_args(family, "debug", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
                                              "vocab_size": 300})
    torch.manual_seed(0)
    model = MODELS[family].model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)
    labels[0, :3] = IGNORE_INDEX
    step = ForwardBackward(model, None, torch.device("cpu"), autocast_dtype=torch.bfloat16 if autocast else None,
                           loss_parallel=False, cp_impl="allgather", output_chunks=3, fused_output=fused)
    assert step.fused_output == fused
    loss = step.run([(tokens, labels)], backward=True)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama3", "gemma2"])  # gemma2: tied embeddings, soft-capped logits
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_output_loss_equals_the_unfused_step(family, autocast):
    loss, grads = _losses_and_grads(family, True, autocast)
    expected_loss, expected = _losses_and_grads(family, False, autocast)
    tol = 2e-2 if autocast else 1e-5
    assert loss == pytest.approx(expected_loss, rel=tol)
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=tol, atol=tol * 1e-1, msg=name)


def test_a_fused_step_refuses_an_output_projection_it_would_bypass():
    args = build_model_args("llama3", "debug", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2})
    model = MODELS["llama3"].model_cls(args)
    model.output.forward = lambda x: x  # anything but nn.Linear's own forward (an adapter, a float8 linear)
    with pytest.raises(ValueError, match="plain nn.Linear output projection"):
        ForwardBackward(model, None, torch.device("cpu"), autocast_dtype=None, loss_parallel=False,
                        cp_impl="allgather", output_chunks=1, fused_output=True)
