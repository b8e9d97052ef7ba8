"""The MoE experts' two paths (grouped_mm and the per-expert loop) agree, and the whole layer equals a
per-token reference: every token through each of its top-k experts, weighted by its router."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.nn.feed_forward import FeedForward
from ember.nn.moe import Experts, MoE, _grouped_available
from ember.nn.moe_stats import MoEOptions, MoEStats

# Only the grouped path needs the kernel; the loop and the references run on any torch.
needs_grouped_mm = pytest.mark.skipif(not hasattr(F, "grouped_mm"),
                                      reason="torch.nn.functional.grouped_mm (the grouped GEMM kernel) is missing")
GROUPED = pytest.param("grouped", marks=needs_grouped_mm)


def _experts(n_experts: int = 6, dim: int = 32, hidden: int = 48) -> Experts:
    experts = Experts(n_experts, dim, hidden)
    experts.init_weights(out_std=0.1)
    return experts


def _run(experts: Experts, x: torch.Tensor, counts: torch.Tensor, impl: str,
         grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of x, w1, w2, w3 for an upstream gradient grad_out, through one path."""
    experts.force_impl(impl)
    x = x.detach().requires_grad_()
    out = experts(x, counts, grouped=impl == "grouped")
    params = [x, experts.w1, experts.w2] + ([experts.w3] if experts.gated else [])
    grads = torch.autograd.grad(out, params, grad_out)
    return out.detach(), list(grads)


@needs_grouped_mm
@pytest.mark.parametrize("counts", [
    [5, 0, 9, 0, 3, 7],  # two experts get no token
    [0, 0, 24, 0, 0, 0],  # one expert gets every token
    [4, 4, 4, 4, 4, 4],
])
def test_grouped_path_equals_looped_path_with_gradients(counts: list[int]):
    torch.manual_seed(0)
    experts = _experts()
    counts_t = torch.tensor(counts)
    x = torch.randn(sum(counts), 32)
    grad_out = torch.randn(sum(counts), 32)  # dense, as MoE's routing weights make it
    out_g, grads_g = _run(experts, x, counts_t, "grouped", grad_out)
    out_l, grads_l = _run(experts, x, counts_t, "looped", grad_out)
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
    for name, grad_g, grad_l in zip(["x", "w1", "w2", "w3"], grads_g, grads_l):
        torch.testing.assert_close(grad_g, grad_l, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    for e, n in enumerate(counts):
        if n == 0:  # an expert without tokens has zero gradient on both paths
            assert grads_g[1][e].abs().max() == 0 and grads_g[2][e].abs().max() == 0


@needs_grouped_mm
def test_grouped_path_under_bf16_autocast_runs_in_bf16_like_the_loop():
    # CUDA trains under bf16 autocast with an fp32 residual stream: grouped_mm is on no autocast list, so
    # Experts casts itself; on CPU autocast shows the same behaviour.
    torch.manual_seed(0)
    experts = _experts()
    counts = torch.tensor([5, 0, 9, 0, 3, 7])
    x = torch.randn(24, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _grouped_available(x)
        out_g, grads_g = _run(experts, x, counts, "grouped", torch.randn(24, 32))
        experts.force_impl("looped")
        out_l = experts(x, counts, grouped=False)
    assert out_g.dtype == out_l.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads_g[1:])  # fp32 master weights keep fp32 gradients
    torch.testing.assert_close(out_g, out_l, rtol=1e-2, atol=1e-2)


@needs_grouped_mm
def test_path_choice_is_explicit_and_forcible(monkeypatch: pytest.MonkeyPatch):
    assert _grouped_available(torch.randn(4, 256))  # CPU fp32, 1 KiB rows
    assert _grouped_available(torch.randn(4, 256, dtype=torch.bfloat16))
    assert not _grouped_available(torch.randn(4, 30))  # 120-byte rows: grouped_mm's stride check refuses them
    assert not _grouped_available(torch.randn(4, 256, dtype=torch.float64))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _grouped_available(torch.randn(4, 256))  # fp32 grouped_mm does not compile (bf16 only)
    assert _grouped_available(torch.randn(4, 256, dtype=torch.bfloat16))
    monkeypatch.undo()

    calls = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    experts = _experts()
    x, counts = torch.randn(24, 32), torch.tensor([5, 0, 9, 0, 3, 7])
    experts(x, counts, grouped=True)
    assert len(calls) == 2  # w1 and w3 fused, w2
    experts.force_impl("looped")  # forced: the caller's choice is ignored
    experts(x, counts, grouped=True)
    assert len(calls) == 2
    experts.force_impl("grouped")
    experts(x, counts, grouped=False)
    assert len(calls) == 4
    with pytest.raises(ValueError, match="impl"):
        experts.force_impl("batched")
    odd = _experts(hidden=30)  # hidden rows of 120 bytes: the loop, whatever the caller says
    odd(x, counts, grouped=True)
    assert len(calls) == 4


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ moe.router.gate.weight.t()
    probs = torch.softmax(logits.float(), dim=-1)
    out = torch.zeros_like(flat)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(flat.shape[0]):
        top = torch.topk(probs[t], moe.top_k)
        weights = top.values / top.values.sum()
        for w, e in zip(weights, top.indices):
            h = F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])  # (hidden,)
            out[t] = out[t] + w * (w2[e] @ h)
    return out.reshape(x.shape)


@pytest.mark.parametrize("impl", [GROUPED, "looped"])
@pytest.mark.parametrize("batch, seq", [(1, 3), (2, 8)])  # 3 tokens: 6 slots over 8 experts leave some empty
def test_moe_layer_equals_per_token_reference(impl: str, batch: int, seq: int):
    torch.manual_seed(0)
    stats = MoEStats()
    moe = MoE(dim=32, hidden_dim=48, n_experts=8, top_k=2, options=MoEOptions(stats=stats))
    moe.init_weights(out_std=0.1)
    moe.experts.force_impl(impl)
    x = torch.randn(batch, seq, 32)
    out = moe(x)
    load = stats.of(moe).tokens_per_expert
    assert int(load.sum()) == batch * seq * 2
    assert batch * seq > 3 or (load == 0).any()
    with torch.no_grad():
        expected = _per_token_reference(moe, x)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", [GROUPED, "looped"])
@pytest.mark.parametrize("scale_input", [False, True])  # True: Llama 4 weights the expert's input, not its output
def test_moe_layer_under_bf16_autocast_follows_its_fp32_output(impl: str, scale_input: bool):
    # bf16 training: an fp32 residual stream, bf16 expert products. Both weightings sum the k experts in the
    # stream's dtype (an un-promoted bf16 sum once failed index_add_ for Llama 4 on a GPU).
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=48, n_experts=8, top_k=2, scale_input=scale_input,
              shared_expert=FeedForward(32, 48))
    moe.init_weights(out_std=0.1)
    moe.experts.force_impl(impl)
    x = torch.randn(2, 8, 32)
    reference = moe(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    out.float().sum().backward()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.detach(), reference, rtol=5e-2, atol=5e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.experts.parameters())


@pytest.mark.parametrize("scale_input", [False, True])
@pytest.mark.parametrize("tokens", [1, 4])  # 4 tokens x top-2 = 8 slots = 8 experts: the most that gather
def test_decoding_gathers_each_tokens_experts_with_the_sorted_paths_result(scale_input: bool, tokens: int):
    torch.manual_seed(0)
    stats = MoEStats()
    moe = MoE(dim=32, hidden_dim=48, n_experts=8, top_k=2, scale_input=scale_input, shared_expert=FeedForward(32, 48),
              options=MoEOptions(stats=stats))
    moe.init_weights(out_std=0.1)
    x = torch.randn(1, tokens, 32)
    with torch.no_grad():
        sorted_path = moe.train()(x)
        calls = []
        moe.experts.register_forward_hook(lambda *_: calls.append(1))  # the sorted path's only way to the experts
        gathered = moe.eval()(x)
    assert calls == []
    torch.testing.assert_close(gathered, sorted_path, rtol=1e-5, atol=1e-6)
    assert stats.of(moe).tokens_per_expert.sum() == tokens * 2
    with torch.no_grad():
        moe(torch.randn(1, 5, 32))  # 10 slots, past the 8 experts: sorted again
    assert calls == [1]


@needs_grouped_mm
def test_moe_layer_gradients_equal_across_paths():
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=48, n_experts=8, top_k=2)
    moe.init_weights(out_std=0.1)
    x = torch.randn(2, 16, 32)
    grad_out = torch.randn(2, 16, 32)
    results = {}
    for impl in ("grouped", "looped"):
        moe.experts.force_impl(impl)
        xi = x.clone().requires_grad_()
        out = moe(xi)
        params = [xi] + list(moe.parameters())
        results[impl] = (out.detach(), torch.autograd.grad(out, params, grad_out))
    torch.testing.assert_close(results["grouped"][0], results["looped"][0], rtol=1e-5, atol=1e-5)
    for grad_g, grad_l in zip(results["grouped"][1], results["looped"][1]):
        torch.testing.assert_close(grad_g, grad_l, rtol=1e-5, atol=1e-5)


@needs_grouped_mm
def test_ungated_relu_experts_grouped_equal_looped():
    # GLaM's two-matrix ReLU experts: the same Experts module with gated=False has no w3.
    torch.manual_seed(0)
    experts = Experts(4, 16, 32, activation=F.relu, gated=False)
    experts.init_weights(out_std=0.1)
    assert experts.w3 is None and [n for n, _ in experts.named_parameters()] == ["w1", "w2"]
    x, counts, grad_out = torch.randn(10, 16), torch.tensor([2, 3, 0, 5]), torch.randn(10, 16)
    out_l, grads_l = _run(experts, x, counts, "looped", grad_out)
    out_g, grads_g = _run(experts, x, counts, "grouped", grad_out)
    expected = torch.cat([torch.relu(b @ w1.t()) @ w2.t() for b, w1, w2, n in
                          zip(x.split(counts.tolist()), experts.w1, experts.w2, counts) if n > 0])
    torch.testing.assert_close(out_l, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    for grad_g, grad_l in zip(grads_g, grads_l):
        torch.testing.assert_close(grad_g, grad_l, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["looped", GROUPED])
def test_repeated_steps_give_bit_identical_gradients(impl: str):
    """Exact resume needs a step to be a function of its inputs: the routed tokens' gather sums its gradient over a
    token's k slots in a fixed order (index_select's backward; indexing's accumulated index_put_ did not, on CPU)."""
    torch.manual_seed(0)
    moe = MoE(256, 128, 16, 4)
    moe.init_weights(0.02)
    moe.train()
    moe.experts.force_impl(impl)
    x0 = torch.randn(4, 64, 256)

    def gradients() -> list[torch.Tensor]:
        moe.zero_grad()
        x = x0.clone().requires_grad_()
        out = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]

    first = gradients()
    for _ in range(6):
        assert all(torch.equal(a, b) for a, b in zip(first, gradients()))
