"""LoRA on the MoE families keeps what training moves besides the adapters: DeepSeek-V3's router score biases follow
each step's expert loads (model.bias_update_rate) under LoRA too. A LoRA checkpoint holds them, so a run resumed
from its step-2 checkpoint in another process logs the straight run's losses and gradient norms bit for bit (every
MoE family), and the run read back (load_model: eval, generate, convert) is the model training left."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember.errors import CheckpointError
from ember.model_io.convert import convert
from ember.model_io.load import load_model
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import job_env

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "runs_worker.py"
SMALL = ["model.flavor=debug", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.vocab_size=512",
         "data.dataset=synthetic", "seq_len=32", "global_batch_size=8", "micro_batch_size=8", "logging_steps=1",
         "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false", "optim.lr=1e-2",
         "schedule.warmup_steps=0"]
LORA = ["lora.rank=4", "lora.alpha=8"]
DENSE = "lora.targets=[attn,feed_forward.w1,feed_forward.w2,feed_forward.w3]"
# Every MoE family, two layers: one with experts and, where the family has them, one dense layer whose SwiGLU (GLaM:
# gated GELU) LoRA adapts beside attention.
FAMILIES = {
    "mixtral": ["model.n_kv_heads=2", "model.ffn_hidden_dim=32", "model.n_experts=4", "model.top_k=2",
                "lora.targets=attn"],
    "glam": ["model.ffn_hidden_dim=64", "model.n_experts=4", "model.top_k=2", DENSE],  # layer 0 MoE, layer 1 dense
    "llama4": ["model.n_kv_heads=2", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4", DENSE],
    "qwen3_moe": ["model.n_kv_heads=2", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=4",
                  "model.top_k=2", "model.sparse_step=2", DENSE],
    "deepseek_v2": ["model.n_kv_heads=null", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=8",
                    "model.top_k=2", DENSE],
    "deepseek_v3": ["model.n_kv_heads=null", "model.ffn_hidden_dim=96", "model.moe_hidden_dim=32", "model.n_experts=8",
                    "model.top_k=2", DENSE],
}


def _train(out: Path, cases: dict[str, list[str]]) -> dict:
    """Every case trained in one subprocess (runs_worker.py); each one's {step: [loss, grad_norm]}."""
    proc = subprocess.run([sys.executable, str(WORKER), str(out), json.dumps(cases), *SMALL], capture_output=True,
                          text=True, env=job_env(), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _model(family: str) -> list[str]:
    return [f"model.family={family}", *(o for o in FAMILIES[family] if not o.startswith("lora."))]


def _lora(family: str, base: Path) -> list[str]:
    """A LoRA run of `family` on `base`."""
    return [*_model(family), *LORA, *(o for o in FAMILIES[family] if o.startswith("lora.")), f"model.init_from={base}"]


def test_every_moe_family_s_lora_run_resumes_bit_for_bit(tmp_path):
    # DeepSeek-V3's checkpoint held no score biases: resumed, the run routed by the base's and its losses drifted
    runs = tmp_path / "straight.json.runs"
    cases: dict[str, list[str]] = {}
    for family in FAMILIES:
        cases[f"{family}-base"] = [*_model(family), "max_steps=2"]
        cases[family] = [*_lora(family, runs / f"{family}-base"), "max_steps=6", "checkpoint.interval=2",
                         "checkpoint.keep=0"]
    straight = _train(tmp_path / "straight.json", cases)
    resumed = _train(tmp_path / "resumed.json", {
        family: [*cases[family], f"resume={runs / family / 'checkpoints' / 'step-2'}"] for family in FAMILIES})
    for family in FAMILIES:
        # bit for bit
        assert resumed[family] == {str(step): straight[family][str(step)] for step in range(3, 7)}, family


def test_a_deepseek_v3_lora_run_is_read_back_with_its_score_biases(tmp_path):
    base, run = tmp_path / "base", tmp_path / "lora"
    Trainer(run_lib.load_config("debug", [*SMALL, *_model("deepseek_v3"), "max_steps=1",
                                          f"output_dir={base}"])).train()
    trainer = Trainer(run_lib.load_config("debug", [*SMALL, *_lora("deepseek_v3", base), "max_steps=3",
                                                    f"output_dir={run}"]))
    trainer.train()
    trained = {name: b.clone() for name, b in trainer.model_parts[0].named_buffers() if name.endswith("score_bias")}
    base_biases = dict(load_model(base).named_buffers())
    assert trained and all(not torch.equal(bias, base_biases[name]) for name, bias in trained.items())  # they moved
    loaded = dict(load_model(run).named_buffers())  # what eval, generate and convert run
    assert all(torch.equal(loaded[name], bias) for name, bias in trained.items())
    convert(run, tmp_path / "merged", "hf")
    exported = load_file(tmp_path / "merged" / "model.safetensors")
    for name, bias in trained.items():  # layers.1.moe.router.score_bias -> its HF name
        layer = name.split(".")[1]
        assert torch.equal(exported[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"], bias)
    with pytest.raises(CheckpointError) as info:
        convert(run, tmp_path / "adapter", "peft")
    assert str(info.value) == (
        f"'{run}': training moved layers.1.moe.router.score_bias, a buffer a peft adapter cannot hold (it holds "
        "lora_A and lora_B only); export the run merged into its base with --merge, or train with those buffers "
        "frozen (model.bias_update_rate=0 for score biases)")
    assert not (tmp_path / "adapter").exists()


def test_dpo_s_reference_on_a_deepseek_v3_lora_policy_is_the_base_with_its_score_biases(tmp_path):
    """DPO on LoRA takes the policy with its adapters off as the reference: the score biases training moved are put
    back to the base's for that forward (then restored), and the reference's forward counts no expert load."""
    from ember.finetune.dpo import as_base
    from ember.nn.moe import MoE

    base, run = tmp_path / "base", tmp_path / "lora"
    Trainer(run_lib.load_config("debug", [*SMALL, *_model("deepseek_v3"), "max_steps=1",
                                          f"output_dir={base}"])).train()
    base_model = load_model(base)
    start = {name: b.clone() for name, b in base_model.named_buffers() if name.endswith("score_bias")}
    trainer = Trainer(run_lib.load_config("debug", [*SMALL, *_lora("deepseek_v3", base), "max_steps=3",
                                                    f"output_dir={run}"]))
    trainer.train()
    policy = trainer.model_parts[0].train()
    trained = {name: b.clone() for name, b in policy.named_buffers() if name in start}
    assert all(not torch.equal(trained[name], start[name]) for name in start)  # training moved them
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base_model(tokens)
        with as_base(policy, start):
            got = policy(tokens)
        adapted = policy(tokens)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    assert not torch.allclose(adapted, expected, atol=1e-3)  # the policy itself is not the base
    assert policy.training and all(torch.equal(b, trained[n]) for n, b in policy.named_buffers() if n in trained)
    stats = trainer.engine.moe_stats
    moes = [m for m in policy.modules() if isinstance(m, MoE)]
    loads = [len(stats.of(m).loads) for m in moes]
    with torch.no_grad(), as_base(policy, start):
        policy(tokens)
    assert [len(stats.of(m).loads) for m in moes] == loads


def test_a_lora_checkpoint_saved_without_buffers_loads_and_resumes_on_the_base_s(tmp_path, monkeypatch, capsys):
    # what a LoRA checkpoint held before buffers were kept: the trainable tensors only
    import ember.checkpoint.manager
    from ember.finetune.lora import trainable_state_dict

    base, run = tmp_path / "base", tmp_path / "lora"
    Trainer(run_lib.load_config("debug", [*SMALL, *_model("deepseek_v3"), "max_steps=1",
                                          f"output_dir={base}"])).train()
    lora = [*SMALL, *_lora("deepseek_v3", base), "checkpoint.interval=2", f"output_dir={run}"]
    with monkeypatch.context() as old:
        old.setattr(ember.checkpoint.manager, "lora_state_dict", trainable_state_dict)
        old.setattr(ember.checkpoint.manager, "start_buffers", lambda parts: {})
        Trainer(run_lib.load_config("debug", [*lora, "max_steps=2"])).train()
    base_biases = {n: b for n, b in load_model(base).named_buffers() if n.endswith("score_bias")}
    loaded = dict(load_model(run).named_buffers())
    assert all(torch.equal(loaded[name], bias) for name, bias in base_biases.items())
    capsys.readouterr()
    Trainer(run_lib.load_config("debug", [*lora, "max_steps=3", "metrics.console=true"])).train()
    assert (f"note: {run / 'checkpoints' / 'step-2'} holds no layers.1.moe.router.score_bias (saved before LoRA "
            "checkpoints kept buffers): the run goes on from the base's") in capsys.readouterr().out
    assert "step-3" in {p.name for p in (run / "checkpoints").iterdir()}
