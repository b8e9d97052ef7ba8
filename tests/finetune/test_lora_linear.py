"""LoraLinear's fused adapter step: one backward for the frozen weight's input gradient and both adapters',
equal to autograd's ops on the same math, in fp64 and under bf16 autocast (fp32 gradients)."""

import pytest
import torch

from ember.finetune.lora import LoraLinear, apply_lora


def _adapted_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> LoraLinear:
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.proj = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": block})  # apply_lora adapts the Linears of the blocks in `layers`
    apply_lora(model, rank=3, alpha=6.0, dropout=0.0, targets=["proj"])
    linear = block.proj.to(dtype)  # the adapters too
    torch.nn.init.normal_(linear.lora_B.weight)  # B = 0 at init would hide A's gradient
    return linear


def _plain_lora(linear: LoraLinear, x: torch.Tensor) -> torch.Tensor:
    """The adapted layer as autograd's ops, the way the module computed it before its fused path."""
    return torch.nn.functional.linear(x, linear.weight, linear.bias) + \
        linear.lora_B(linear.lora_A(x)) * linear.scaling


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_grad", [True, False])
def test_the_fused_adapter_step_equals_autograds_ops(bias, input_grad):
    linear = _adapted_linear(8, 6, bias, torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=input_grad)
    grad = torch.randn(2, 5, 6, dtype=torch.float64)
    results = []
    for forward in (linear, lambda t: _plain_lora(linear, t)):
        out = forward(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, linear.lora_A.weight.grad, linear.lora_B.weight.grad))
        x.grad, linear.lora_A.weight.grad, linear.lora_B.weight.grad = None, None, None
    (fused, *fused_grads), (plain, *plain_grads) = results
    assert "_FrozenLinearWithAdapterBackward" in str(linear(x).grad_fn.next_functions)  # the fused path ran
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    assert (fused_grads[0] is None) == (not input_grad)
    for got, want in zip(fused_grads, plain_grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert linear.weight.grad is None and (linear.bias is None or linear.bias.grad is None)


def test_the_fused_adapter_step_under_bf16_autocast_keeps_fp32_gradients():
    linear = _adapted_linear(32, 16, False, torch.float32)
    linear.weight.data = linear.weight.data.bfloat16()  # the frozen base in bf16, as a bf16 LoRA run stores it
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert linear.lora_A.weight.grad.dtype == torch.float32 and linear.lora_B.weight.grad.dtype == torch.float32
    # against the same math in fp64 on the same (bf16-rounded) operands: bf16 GEMMs agree to bf16's precision
    reference = _adapted_linear(32, 16, False, torch.float64)
    reference.weight.data = linear.weight.data.double()
    reference.lora_A.weight.data = linear.lora_A.weight.data.bfloat16().double()
    reference.lora_B.weight.data = linear.lora_B.weight.data.bfloat16().double()
    x64 = x.detach().bfloat16().double().requires_grad_()
    expected = _plain_lora(reference, x64)
    expected.square().sum().backward()
    for got, want in ((out, expected), (x.grad, x64.grad), (linear.lora_A.weight.grad, reference.lora_A.weight.grad),
                      (linear.lora_B.weight.grad, reference.lora_B.weight.grad)):
        assert (got.double() - want).norm() / want.norm() < 1e-2  # bf16 GEMMs: within bf16's precision
