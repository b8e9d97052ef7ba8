"""GRPO's advantages and policy loss (ember/finetune/grpo_loss.py) on hand-computed cases: group and batch
normalization, a group of equal rewards that contributes no gradient, the asymmetric clip (and no gradient
through a clipped token), each loss type's normalization and the k3 KL term."""

import math

import pytest
import torch

from ember.finetune.grpo_loss import STD_EPS, group_advantages, policy_loss, token_logprobs


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(4 * 0.25 / 3)  # the unbiased std of (1, 0, 0, 1)
    expected = [0.5 / (std + STD_EPS), -0.5 / (std + STD_EPS)] * 2
    adv = group_advantages(rewards, 4, "group")
    assert adv[:4].tolist() == pytest.approx([expected[0], expected[1], expected[1], expected[0]], rel=1e-6)
    assert adv[4:].tolist() == [0.0] * 4  # equal rewards: exactly zero
    assert group_advantages(rewards, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    batch_std = rewards.std().item()
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [a / (batch_std + STD_EPS) for a in (0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0)], rel=1e-6)
    with pytest.raises(ValueError, match="are not groups of 3"):
        group_advantages(rewards, 3)


def test_a_group_of_equal_rewards_contributes_no_gradient():
    logprobs = torch.randn(4, 5, requires_grad=True)
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, torch.ones(4, 5))
    loss.backward()
    assert torch.count_nonzero(logprobs.grad[:2]) == 0 and torch.count_nonzero(logprobs.grad[2:]) > 0


def test_the_clip_by_hand_and_no_gradient_through_a_clipped_token():
    # one completion per advantage sign; ratios 1.5, 0.9 (A = +1) and 0.5, 1.1 (A = -1); clip [0.8, 1.28]
    ratios = torch.tensor([[1.5, 0.9], [0.5, 1.1]])
    logprobs = ratios.log().clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                              loss_type="bnpo", clip_low=0.2, clip_high=0.28)
    per_token = [-min(1.5, 1.28), -0.9, max(0.5, 0.8), 1.1]  # -min(r * A, clip(r) * A)
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-6)
    loss.backward()
    # d(-r A)/d log r = -r A where the ratio is used, 0 where it was clipped; / 4 tokens
    assert logprobs.grad.flatten().tolist() == pytest.approx([0.0, -0.9 / 4, 0.0, 1.1 / 4], rel=1e-6)
    assert stats["clipped_high"].item() == 0.25 and stats["clipped_low"].item() == 0.25


def test_each_loss_type_normalizes_as_documented():
    # completions of 1 and 3 counted tokens; every token's loss is -A (ratio 1), A = 1 and 2
    logprobs = torch.zeros(2, 4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    adv = torch.tensor([1.0, 2.0])
    sums, lengths = [-1.0, -6.0], [1, 3]

    def loss(kind: str, **kw) -> float:
        return policy_loss(logprobs, logprobs, adv, mask, loss_type=kind, **kw)[0].item()

    assert loss("grpo") == pytest.approx((sums[0] / lengths[0] + sums[1] / lengths[1]) / 2)
    assert loss("bnpo") == pytest.approx(sum(sums) / 4)
    assert loss("dr_grpo", max_completion_length=8) == pytest.approx(sum(sums) / (2 * 8))
    assert loss("dapo", token_count=torch.tensor(16.0)) == pytest.approx(sum(sums) / 16)
    with pytest.raises(ValueError, match="give token_count"):
        loss("dapo")
    with pytest.raises(ValueError, match="choose one of grpo, bnpo, dr_grpo, dapo"):
        loss("ppo")


def test_the_k3_kl_term_by_hand():
    logprobs = torch.tensor([[0.0, math.log(0.5)]])  # reference log-probs 0: q = 0 and log 2
    loss, stats = policy_loss(logprobs, logprobs, torch.zeros(1), torch.ones(1, 2), loss_type="bnpo", beta=0.1,
                              ref_logprobs=torch.zeros(1, 2))
    kl = [0.0, 2 - math.log(2) - 1]
    assert stats["kl"].item() == pytest.approx(sum(kl) / 2)
    assert loss.item() == pytest.approx(0.1 * sum(kl) / 2)


def test_token_logprobs_are_log_softmax_at_the_token():
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, -1)[torch.arange(2)[:, None], torch.arange(3)[None], tokens]
    assert torch.equal(token_logprobs(logits, tokens), expected)


def test_micro_batches_given_the_whole_batchs_counts_sum_to_its_loss_and_gradient():
    """Six completions of unequal lengths split 1 + 2 + 3 (as micro-batches over ranks would be): with rows_total
    and token_count of the whole batch, the parts' losses and gradients sum to the whole batch's, per loss type."""
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g)
    ref, adv = -torch.rand(6, 5, generator=g), torch.randn(6, generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).long()
    tokens = mask.sum().float()
    for kind in ("grpo", "bnpo", "dr_grpo", "dapo"):
        options = dict(loss_type=kind, clip_low=0.2, clip_high=0.28, beta=0.05, ref_logprobs=ref,
                       max_completion_length=5, token_count=tokens)
        whole_in = logprobs.clone().requires_grad_(True)
        whole, _ = policy_loss(whole_in, old, adv, mask, **options)
        whole.backward()
        parts_in = logprobs.clone().requires_grad_(True)
        total = sum(policy_loss(parts_in[a:b], old[a:b], adv[a:b], mask[a:b], rows_total=6,
                                **{**options, "ref_logprobs": ref[a:b]})[0] for a, b in ((0, 1), (1, 3), (3, 6)))
        total.backward()
        assert total.item() == pytest.approx(whole.item(), rel=1e-6), kind
        torch.testing.assert_close(parts_in.grad, whole_in.grad, rtol=1e-6, atol=1e-8)
