"""Optimizer groups, LR schedules against hand-computed values, gradient clipping."""

import math

import pytest
import torch
from torch import nn

from ember.config import ConfigError, OptimConfig, ScheduleConfig
from ember.train.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_multiplier

# warmup 10, max_steps 100, min_lr_ratio 0.1. Warmup: (s+1)/11. After it, with n = s+1, the decay
# progress is p = (n - 10)/90 for cosine and linear; wsd decays over the last 0.2*100 = 20 steps, p = (n - 80)/20.
#   cosine s=10: p = 1/90,  0.1 + 0.45*(1 + cos 2deg)  = 0.1 + 0.45*1.9993908 = 0.9997259
#   cosine s=55: p = 46/90, 0.1 + 0.45*(1 + cos 92deg) = 0.1 + 0.45*0.9651005 = 0.5342952
#   linear s=10: 1 - 0.9/90 = 0.99;  s=55: 1 - 0.9*46/90 = 0.54
#   wsd    s=80: 1 - 0.9/20 = 0.955; s=89: 1 - 0.9*10/20 = 0.55
HAND_VALUES = {
    "cosine": {0: 1 / 11, 9: 10 / 11, 10: 0.9997259, 55: 0.5342952, 99: 0.1},
    "linear": {0: 1 / 11, 9: 10 / 11, 10: 0.99, 55: 0.54, 99: 0.1},
    "wsd": {0: 1 / 11, 9: 10 / 11, 10: 1.0, 55: 1.0, 79: 1.0, 80: 0.955, 89: 0.55, 99: 0.1},
    "constant": {0: 1 / 11, 9: 10 / 11, 10: 1.0, 55: 1.0, 99: 1.0},
}


@pytest.mark.parametrize("name", sorted(HAND_VALUES))
def test_lr_multiplier_hand_values(name):
    cfg = ScheduleConfig(name=name, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    for step, expected in HAND_VALUES[name].items():
        assert lr_multiplier(step, cfg, max_steps=100) == pytest.approx(expected, abs=1e-6), (name, step)
    # A run extended past max_steps (resume with a larger budget) stays at the floor, never below it.
    if name != "constant":
        assert lr_multiplier(150, cfg, max_steps=100) == pytest.approx(0.1)


def test_lr_scheduler_sets_the_lr_each_step_runs_with():
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3), "cpu")
    cfg = ScheduleConfig(name="linear", warmup_steps=10, min_lr_ratio=0.1)
    scheduler = build_lr_scheduler(optimizer, cfg, max_steps=100)
    seen = []
    for _ in range(100):
        seen.append(optimizer.param_groups[0]["lr"])  # what optimizer.step() would use now
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(1e-3 / 11)
    assert seen[55] == pytest.approx(1e-3 * 0.54)
    assert seen[99] == pytest.approx(1e-4)
    assert "lr_lambdas" in scheduler.state_dict()  # checkpointable


def test_unknown_schedule_fails_at_build_time():
    optimizer = build_optimizer(nn.Linear(2, 2), OptimConfig(), "cpu")
    with pytest.raises(ConfigError, match=r"schedule\.name 'cosin'.*cosine, linear, wsd, constant"):
        build_lr_scheduler(optimizer, ScheduleConfig(name="cosin"), max_steps=10)


class TinyLM(nn.Module):
    """The parameter kinds of a Llama: embedding, matrices, an RMSNorm-style gain, a bias, a tied head."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.wq = nn.Linear(8, 8, bias=False)
        self.w1 = nn.Linear(8, 16)  # with a bias
        self.norm = nn.LayerNorm(8)
        self.gain = nn.Parameter(torch.ones(8))  # a hand-written RMSNorm's weight
        self.output = nn.Linear(8, 16, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


def test_weight_decay_groups():
    model = TinyLM()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1), "cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.wq.weight), id(model.w1.weight)}
    expected_no_decay = [model.tok_embeddings.weight, model.w1.bias, model.norm.weight, model.norm.bias, model.gain]
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in expected_no_decay}
    assert len(no_decay["params"]) == len(expected_no_decay)  # the tied weight once; the frozen one never


def test_optimizer_hyperparameters_and_implementation():
    cfg = OptimConfig(lr=1e-3, betas=[0.8, 0.9], eps=1e-6)
    auto_cpu = build_optimizer(nn.Linear(2, 2), cfg, "cpu")
    assert isinstance(auto_cpu, torch.optim.AdamW)
    assert auto_cpu.defaults["betas"] == (0.8, 0.9) and auto_cpu.defaults["eps"] == 1e-6
    assert auto_cpu.defaults["lr"] == 1e-3
    assert auto_cpu.defaults["fused"]  # auto picks fused on CPU (measured ~6x faster than foreach)
    assert build_optimizer(nn.Linear(2, 2), cfg, "xla").defaults["foreach"]  # no fused kernel known there
    for implementation, fused, foreach in [("fused", True, False), ("foreach", False, True),
                                           ("for-loop", False, False)]:
        cfg.implementation = implementation
        optimizer = build_optimizer(nn.Linear(2, 2), cfg, "cpu")
        assert (optimizer.defaults["fused"], optimizer.defaults["foreach"]) == (fused, foreach)


def test_unknown_optimizer_and_implementation_name_the_key_and_choices():
    with pytest.raises(ValueError, match=r"optim\.name 'sgd'.*adamw"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(name="sgd"), "cpu")
    with pytest.raises(ValueError, match=r"optim\.implementation 'fast'.*auto, fused, foreach, for-loop"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(implementation="fast"), "cpu")


def test_fused_and_foreach_agree():
    torch.manual_seed(0)
    start = TinyLM()
    results = []
    for implementation in ("fused", "foreach"):
        model = TinyLM()
        model.load_state_dict(start.state_dict())
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2, implementation=implementation), "cpu")
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        results.append(model.state_dict())
    for key in results[0]:
        torch.testing.assert_close(results[0][key], results[1][key])


def test_clip_grad_norm():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(3))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # total norm 5; one has no grad
    norm = clip_grad_norm_(params, max_norm=0)  # measure only
    assert norm.item() == pytest.approx(5.0) and params[0].grad.tolist() == [3.0, 0.0]
    norm = clip_grad_norm_(iter(params), max_norm=1.0)  # a generator, as model.parameters() is
    assert norm.item() == pytest.approx(5.0)  # the norm before clipping, as torch returns it
    clipped = math.sqrt(sum(float(p.grad.square().sum()) for p in params[:2]))
    assert clipped == pytest.approx(1.0, rel=1e-4)


def test_a_misspelled_optimizer_or_schedule_gets_the_closest_choice():
    from ember.config import ConfigError
    from ember.train import run as run_lib
    from ember.train.optim import build_optimizer, lr_multiplier

    cfg = run_lib.load_config("debug", ["optim.implementation=fusd", "schedule.name=Cosine"])
    with pytest.raises(ConfigError, match=r"unknown optim.implementation 'fusd' \(did you mean 'fused'\?\)"):
        build_optimizer(torch.nn.Linear(2, 2), cfg.optim, "cpu")
    with pytest.raises(ConfigError, match=r"unknown schedule.name 'Cosine' \(did you mean 'cosine'\?\); choices"):
        lr_multiplier(50, cfg.schedule, 100)
