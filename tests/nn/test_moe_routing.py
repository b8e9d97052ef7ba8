"""The routers and MoE forms of DeepSeek and Llama 4 equal transformers' own modules (indices, weights, outputs and
gradients), and the aux-loss-free score bias moves against each expert's load."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

from ember.nn.feed_forward import FeedForward
from ember.nn.moe import MoE
from ember.nn.moe_stats import MoEOptions, MoEStats, RouterLoss
from ember.nn.router import Router

DIM, E = 32, 16


def _sorted_by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weights, indices) ordered by expert index: the references return their top-k unsorted."""
    order = indices.argsort(dim=-1)
    return weights.gather(1, order), indices.gather(1, order)


def test_sigmoid_group_limited_router_with_score_bias_equals_deepseek_v3():
    config = transformers.DeepseekV3Config(hidden_size=DIM, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    reference = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(reference.weight, std=0.5)
    reference.e_score_correction_bias.normal_(std=0.3)  # large enough to change which experts win
    ours = Router(DIM, E, 4, norm_topk_prob=True, score_func="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5,
                  score_bias=True)
    ours.gate.weight.data.copy_(reference.weight)
    ours.score_bias.copy_(reference.e_score_correction_bias)
    x = torch.randn(64, DIM)
    _, ref_weights, ref_indices = reference(x)
    weights, indices, _ = ours(x)
    ref_weights, ref_indices = _sorted_by_expert(ref_weights, ref_indices)
    weights, indices = _sorted_by_expert(weights, indices)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
    # the bias chooses but does not weigh: without it some choices differ
    ours.score_bias.zero_()
    assert not torch.equal(_sorted_by_expert(*ours(x)[:2])[1], ref_indices)
    # every chosen expert lies in one of the token's topk_groups=2 groups
    assert all(len(set((row // (E // 4)).tolist())) <= 2 for row in indices)


def test_softmax_group_limited_greedy_router_equals_deepseek_v2():
    config = transformers.DeepseekV2Config(hidden_size=DIM, n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                                           topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    reference = DeepseekV2TopkRouter(config)
    torch.manual_seed(1)
    torch.nn.init.normal_(reference.weight, std=0.5)
    ours = Router(DIM, E, 3, norm_topk_prob=False, n_groups=4, topk_groups=2, route_scale=1.5)
    ours.gate.weight.data.copy_(reference.weight)
    x = torch.randn(64, DIM)
    _, ref_weights, ref_indices = reference(x)
    weights, indices = _sorted_by_expert(*ours(x)[:2])
    ref_weights, ref_indices = _sorted_by_expert(ref_weights, ref_indices)
    assert torch.equal(indices, ref_indices)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)


def test_router_refuses_groups_that_cannot_hold_the_top_k():
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        Router(DIM, E, 2, n_groups=3)
    with pytest.raises(ValueError, match="of which 1 hold the top 8"):
        Router(DIM, E, 8, n_groups=4, topk_groups=1)


def _grads(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().requires_grad_()
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {"x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def test_deepseek_v3_moe_with_shared_expert_equals_transformers():
    config = transformers.DeepseekV3Config(hidden_size=DIM, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=24,
                                           n_shared_experts=2)
    torch.manual_seed(2)
    reference = DeepseekV3MoE(config)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    reference.gate.e_score_correction_bias.normal_(std=0.1)
    router = Router(DIM, E, 4, score_func="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5, score_bias=True)
    ours = MoE(DIM, 24, E, 4, router=router, shared_expert=FeedForward(DIM, 48))
    gate, up = reference.experts.gate_up_proj.data.chunk(2, dim=1)  # (E, 2H, D): gate rows first
    ours.experts.w1.data.copy_(gate)
    ours.experts.w3.data.copy_(up)
    ours.experts.w2.data.copy_(reference.experts.down_proj)
    ours.router.gate.weight.data.copy_(reference.gate.weight)
    ours.router.score_bias.copy_(reference.gate.e_score_correction_bias)
    for name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        getattr(ours.shared_expert, name).weight.data.copy_(getattr(reference.shared_experts, hf_name).weight)
    x = torch.randn(2, 10, DIM)
    ref_out, ref_grads = _grads(reference, x)
    out, grads = _grads(ours, x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["x"], ref_grads["x"], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["router.gate.weight"], ref_grads["gate.weight"], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["shared_expert.w1.weight"], ref_grads["shared_experts.gate_proj.weight"],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([grads["experts.w1"], grads["experts.w3"]], dim=1),
                               ref_grads["experts.gate_up_proj"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["looped", "grouped"])
def test_llama4_moe_scales_the_expert_input_and_adds_the_shared_expert(impl: str):
    config = transformers.Llama4TextConfig(hidden_size=DIM, intermediate_size=24, num_local_experts=4,
                                           num_experts_per_tok=1)
    torch.manual_seed(3)
    reference = Llama4TextMoe(config)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoE(DIM, 24, 4, 1, router=Router(DIM, 4, 1, norm_topk_prob=False, score_func="sigmoid"),
               shared_expert=FeedForward(DIM, 24), scale_input=True)
    ours.experts.force_impl(impl)
    gate, up = reference.experts.gate_up_proj.data.chunk(2, dim=2)  # (E, D, 2H): gate columns first
    ours.experts.w1.data.copy_(gate.transpose(1, 2))
    ours.experts.w3.data.copy_(up.transpose(1, 2))
    ours.experts.w2.data.copy_(reference.experts.down_proj.transpose(1, 2))
    ours.router.gate.weight.data.copy_(reference.router.weight)
    for name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        getattr(ours.shared_expert, name).weight.data.copy_(getattr(reference.shared_expert, hf_name).weight)
    x = torch.randn(2, 12, DIM)
    ref_out, ref_grads = _grads(reference, x)
    out, grads = _grads(ours, x)
    torch.testing.assert_close(out, ref_out.view_as(out), rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["x"], ref_grads["x"], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["router.gate.weight"], ref_grads["router.weight"], rtol=0, atol=1e-5)
    torch.testing.assert_close(grads["experts.w2"], ref_grads["experts.down_proj"].transpose(1, 2), rtol=0, atol=1e-5)


def test_score_bias_moves_by_the_rate_against_each_experts_load():
    class Stage(torch.nn.Module):  # what update_score_bias walks: a model part's layers by index
        def __init__(self):
            super().__init__()
            router = Router(8, 4, 1, score_func="sigmoid", score_bias=True)
            self.layers = torch.nn.ModuleDict({"3": MoE(8, 16, 4, 1, router=router, options=MoEOptions(stats=stats))})

    stats = MoEStats()
    stage = Stage()
    moe = stage.layers["3"]
    moe.train()
    stats.of(moe).loads = [torch.tensor([6, 1, 1, 0]), torch.tensor([2, 3, 1, 2])]  # two micro-batches: 8, 4, 2, 2
    stats.end_step(2)
    summed = []
    stats.update_score_bias([stage], 0.01, n_layers=4, n_experts=4, all_sum=lambda t: summed.append(t) or t * 2,
                      device=torch.device("cpu"))
    assert summed[0].shape == (4, 4) and summed[0][3].tolist() == [8, 4, 2, 2]
    # the mean is 4: the overloaded expert goes down, the underloaded ones up, the balanced one stays
    assert moe.router.score_bias.tolist() == pytest.approx([-0.01, 0.0, 0.01, 0.01])


def test_router_loss_metrics_hold_no_graph_unless_the_xla_step_asks():
    """The collector keeps aux_loss and z_loss for the metrics as values, since a graph there would keep the
    forward's activations (under activation checkpointing, each MoE block's recomputed ones) until the next forward."""
    stats = MoEStats()
    # the router loss still reaches the gradient, through the output
    moe = MoE(DIM, 24, E, 2, options=MoEOptions(router_loss=RouterLoss(0.01, 0.0, 1.0), stats=stats))
    moe.train()
    x = torch.randn(2, 8, DIM, requires_grad=True)
    moe(x).sum().backward()
    assert stats.of(moe).aux_loss.grad_fn is None and stats.of(moe).z_loss.grad_fn is None
    assert moe.router.gate.weight.grad is not None
    kept = MoEStats(keep_graph=True)
    traced = MoE(DIM, 24, E, 2, options=MoEOptions(stats=kept))
    traced(x)
    assert kept.of(traced).aux_loss.grad_fn is not None


def test_the_engines_collector_and_dispatch_are_shared_by_a_models_copies_and_count_training_forwards_only():
    """A pipeline stage is a deep copy of the model (parallel/pp.py): its MoE layers still report to the engine's
    collector and keep the run's dispatch. Eval forwards update the latest losses but add no load to the step."""
    stats = MoEStats()
    dispatch = lambda run, tokens, counts, experts: run(tokens, counts)  # noqa: E731
    moe = copy.deepcopy(MoE(DIM, 24, E, 2, options=MoEOptions(dispatch=dispatch, stats=stats)))
    assert moe.options.stats is stats and moe.dispatch is dispatch
    x = torch.randn(2, 8, DIM)
    moe.train()(x)
    with torch.no_grad():
        moe.eval()(x)
    assert len(stats.of(moe).loads) == 1 and int(stats.of(moe).tokens_per_expert.sum()) == 2 * 8 * 2
    stats.end_step(1)
    assert stats.of(moe).step_load.sum() == 2 * 8 * 2 and stats.of(moe).loads == []
