"""LoRA: adapters start at the base's logits, only they train, every layout trains alike, checkpoints are
small and resume bit for bit, and the peft / merged exports load in peft / transformers with ember's logits.

A tiny Llama base is trained once per module (2 steps, synthetic tokens) and every LoRA run starts from it
through model.init_from, as a user's fine-tune starts from a pretrained directory.
"""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from ember.errors import CheckpointError, ConfigError
from ember.finetune.lora import LoraLinear, apply_lora, init_lora, lora_disabled, merge_lora
from ember.hardware.device import cpu_runs_bf16_natively
from ember.model_io.convert import convert
from ember.model_io.load import load_model
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import job_env, kill_injection, losses_by_step, run_ember, run_layouts, tiny_model

# The layouts tests' shape: 4 layers, 4 query / 2 K/V heads (tensor=2 splits them), seq 32.
SHAPE = ["data.dataset=synthetic", *tiny_model(4), "model.vocab_size=512", "seq_len=32", "global_batch_size=8",
         "logging_steps=1", "eval_batches=1", "schedule.warmup_steps=0", "metrics.console=false",
         "metrics.tensorboard=false"]
LORA = ["lora.rank=4", "lora.alpha=8", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A trained (not freshly initialised) base checkpoint: its weights are not the init's, so a LoRA run that
    re-initialised or moved them would show."""
    out = tmp_path_factory.mktemp("base") / "run"
    cfg = run_lib.load_config("debug", SHAPE + ["micro_batch_size=8", "max_steps=2", "optim.lr=1e-2",
                                                f"output_dir={out}"])
    Trainer(cfg).train()
    return out / "checkpoints" / "step-2"


def _lora_run(out: Path, base: Path, *overrides: str, steps: int = 4, shape: list[str] = SHAPE) -> tuple[Trainer, dict]:
    cfg = run_lib.load_config("debug", shape + LORA + ["micro_batch_size=8", f"max_steps={steps}", f"output_dir={out}",
                                                   f"model.init_from={base}", *overrides])
    trainer = Trainer(cfg)
    return trainer, trainer.train()


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory) -> tuple[Path, Trainer, dict]:
    out = tmp_path_factory.mktemp("lora") / "run"
    trainer, summary = _lora_run(out, base, steps=8)
    return out, trainer, summary


def _compute(trainer: Trainer):
    """The autocast a trainer's model runs under (its frozen matrices may be bf16 beside fp32 activations)."""
    return torch.autocast("cpu", dtype=trainer.spec.compute_dtype, enabled=trainer.spec.compute_dtype != torch.float32)


def _tokens(n: int = 2, t: int = 16, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(0))


def test_zero_B_at_init_gives_the_base_logits_exactly(base):
    model = load_model(base)
    tokens = _tokens()
    expected = model(tokens)
    names = apply_lora(model, rank=4, alpha=8, targets="all")
    init_lora([model], seed=0)
    assert len(names) == 4 * 7  # wq wk wv wo w1 w2 w3 in each of 4 layers
    assert all(m.lora_A.weight.abs().sum() > 0 and m.lora_B.weight.abs().sum() == 0
               for m in model.modules() if isinstance(m, LoraLinear))
    assert torch.equal(model(tokens), expected)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}.weight" for n in names for x in "AB"}
    # Checkpoint keys of the base are unchanged: the adapters are extra children.
    assert set(load_model(base).state_dict()) <= set(model.state_dict())


def test_targets_groups_and_names(base):
    for targets, expected in (("attn", {"wq", "wk", "wv", "wo"}), ("mlp", {"w1", "w2", "w3"}),
                              (["wq", "v_proj"], {"wq", "wv"}), ("feed_forward.w2", {"w2"})):
        model = load_model(base)
        names = apply_lora(model, rank=2, alpha=2, targets=targets)
        assert {n.rsplit(".", 1)[1] for n in names} == expected, targets
        assert len(names) == 4 * len(expected)


@pytest.mark.slow
def test_gradients_reach_only_the_adapters_and_the_base_is_unchanged(base, lora_run):
    out, trainer, summary = lora_run
    before = load_model(base).state_dict()
    after = trainer.model.state_dict()
    # Where the CPU has bf16 matmuls, precision=auto stores the frozen matrices in bf16 (embeddings and norms
    # stay fp32); every base weight is then the base's, cast once, bit for bit after 8 optimizer steps.
    stored = torch.bfloat16 if cpu_runs_bf16_natively() else torch.float32
    assert trainer.spec.compute_dtype == stored
    assert after["layers.0.attention.wq.weight"].dtype == after["output.weight"].dtype == stored
    assert after["tok_embeddings.weight"].dtype == after["norm.weight"].dtype == torch.float32
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor.to(after[key].dtype)), key
    adapters_b = [m.lora_B.weight for m in trainer.model.modules() if isinstance(m, LoraLinear)]
    assert all(b.abs().sum() > 0 for b in adapters_b)  # B moved off zero: the adapters trained
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    state_params = {id(p) for p in trainer.optimizer.state}
    assert all(id(p) not in state_params for p in frozen)  # no optimizer state for the base
    assert len(trainer.optimizer.state) == 2 * 4 * 7


@pytest.mark.slow
def test_mfu_counts_the_weight_gradients_a_lora_run_computes(lora_run):
    """6 N counts a weight gradient for every parameter; a LoRA step skips the frozen ones' (2 FLOPs each) and
    adds the adapters' forward and backward (6 each), so MFU is not overstated 1.5x."""
    from ember.models.llama import LlamaArgs, flops_per_token

    _, trainer, _ = lora_run
    args: LlamaArgs = trainer.spec.args
    d, kv, hidden = args.dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, hidden), (hidden, d), (d, hidden)]  # wq wk wv wo w1 w2 w3
    adapters = args.n_layers * sum(4 * (fan_in + fan_out) for fan_in, fan_out in shapes)  # rank 4: A and B
    n = args.n_layers * (sum(i * o for i, o in shapes) + 2 * d) + d + args.vocab_size * d  # 6 N's N, all frozen
    full = flops_per_token(args, 32)
    assert trainer.spec.flops_per_token == full - 2 * n + 6 * adapters
    assert 2 / 3 < trainer.spec.flops_per_token / full < 0.8  # 4 N + adapters + attention of 6 N + attention


@pytest.mark.slow
def test_a_short_lora_run_lowers_the_loss(tmp_path):
    # Text (the embedded corpus), so there is something to learn; random tokens have nothing past ln V. The
    # base is a 1-step model: LoRA alone (rank 8, all targets) must bring its loss down.
    text = [o for o in SHAPE if not o.startswith(("data.dataset", "model.vocab_size"))] + ["micro_batch_size=8"]
    cfg = run_lib.load_config("debug", text + ["max_steps=1", f"output_dir={tmp_path / 'base'}"])
    Trainer(cfg).train()
    _, summary = _lora_run(tmp_path / "lora", tmp_path / "base", "lora.rank=8", "optim.lr=3e-2", steps=20,
                           shape=text)
    assert summary["final_loss_avg"] < summary["first_loss"] - 0.3, summary  # 9.52 -> 9.02 when written


@pytest.mark.slow
def test_the_checkpoint_holds_only_adapters_and_names_its_base(base, lora_run):
    from torch.distributed.checkpoint import FileSystemReader

    out, trainer, _ = lora_run
    step_dir = out / "checkpoints" / "step-8"
    meta = json.loads((step_dir / "model.json").read_text())
    assert meta["base"] == str(base.resolve()) and meta["lora"]["rank"] == 4
    stored = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    model_keys = {k for k in stored if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert len(model_keys) == 2 * 4 * 7
    adapter_numel = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sum(stored[k].size.numel() for k in model_keys) == adapter_numel  # 9,728 of 141,120 parameters
    optim_numel = sum(v.size.numel() for k, v in stored.items() if k.startswith("optim.state.") and v.size.numel() > 1)
    assert optim_numel == 2 * adapter_numel  # Adam's two moments of the adapters, nothing of the base
    size = sum(f.stat().st_size for f in step_dir.glob("*.distcp"))
    base_size = sum(f.stat().st_size for f in base.glob("*.distcp"))
    assert size * 2 < base_size  # ~0.6 MB, most of it DCP's per-tensor framing, vs the base's ~1.7 MB
    # and load_model puts the adapters back on the base: the model the run ended with
    tokens = _tokens()
    trainer.model.eval()
    with torch.no_grad(), _compute(trainer):  # the same bf16 casts of the same fp32 values: bit for bit
        torch.testing.assert_close(load_model(out)(tokens), trainer.model(tokens), rtol=0, atol=0)


@pytest.mark.slow
def test_lora_disabled_gives_the_base_back(base, lora_run):
    out, _, _ = lora_run
    model, tokens = load_model(out), _tokens()
    with torch.no_grad():
        tuned = model(tokens)
        with lora_disabled(model):
            assert torch.equal(model(tokens), load_model(base)(tokens))
        assert torch.equal(model(tokens), tuned)
        assert not torch.equal(tuned, load_model(base)(tokens))


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_lora_losses_equal_one_process(base, tmp_path):
    steps = 3
    # fp32, where every layout must give the single process's losses to rounding; bf16 cases beside it
    common = SHAPE + LORA + [f"max_steps={steps}", f"model.init_from={base}", "precision=fp32"]
    ref_out = tmp_path / "single"
    cfg = run_lib.load_config("debug", common + ["micro_batch_size=8", f"output_dir={ref_out}"])
    Trainer(cfg).train()
    reference = losses_by_step(ref_out)
    cases = {
        "fsdp=2": ["micro_batch_size=4"],
        "tensor=2": ["micro_batch_size=4", "ici_mesh.tensor=2"],
        "tensor=2 compiled": ["micro_batch_size=4", "ici_mesh.tensor=2", "compile=true"],
        "pipeline=2": ["micro_batch_size=4", "ici_mesh.pipeline=2", "parallel.pp_schedule=gpipe"],
        # bf16: the frozen matrices stored in bf16 beside fp32 adapters in one FSDP unit, bf16 all-gathers
        "fsdp=2 bf16": ["micro_batch_size=4", "precision=bf16"],
        # bf16 autocast around the pipeline schedule: its stages' bf16 matrices meet fp32 activations
        "pipeline=2 bf16": ["micro_batch_size=4", "ici_mesh.pipeline=2", "parallel.pp_schedule=gpipe",
                            "precision=bf16"],
    }
    results = run_layouts(tmp_path, 2, cases, common)
    assert set(results) == set(cases)
    ref_loss = [reference[s][0] for s in sorted(reference)]
    ref_norm = [reference[s][1] for s in sorted(reference)]
    assert abs(ref_loss[0] - ref_loss[-1]) > 1e-3  # the adapters move, so agreement is not trivial
    for name, got in results.items():
        rel = 2e-2 if "bf16" in name else 1e-5  # bf16: 8 bits of mantissa in the base and the matmuls
        assert got["loss"] == pytest.approx(ref_loss, rel=rel), name
        assert got["grad_norm"] == pytest.approx(ref_norm, rel=rel * 10), name
    # The adapters saved from shards load on one process as the single run's.
    tokens = _tokens()
    with torch.no_grad():
        expected = load_model(ref_out)(tokens)
        for name in ("fsdp=2", "tensor=2"):
            got = load_model(tmp_path / "results.json.runs" / name)(tokens)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)


def _train_cli(out: Path, base: Path, *extra: str, env: dict | None = None, expect: int = 0):
    return run_ember("train", "debug", *SHAPE, *LORA, "micro_batch_size=4", "max_steps=6", "checkpoint.interval=2",
                     "lora.dropout=0.1", f"model.init_from={base}", f"output_dir={out}", *extra, env=env or job_env(),
                     expect=expect)


@pytest.mark.slow
def test_a_killed_lora_run_resumes_bit_for_bit(base, tmp_path):
    """With dropout on the adapters, so the RNG state is part of what must come back."""
    a, b = tmp_path / "A", tmp_path / "B"
    _train_cli(a, base)
    _train_cli(b, base, env=job_env(PYTHONPATH=str(kill_injection(tmp_path)), EMBER_KILL_AT_STEP="3"),
               expect=-signal.SIGKILL)
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step-2"]
    proc = _train_cli(b, base)
    assert "resumed from" in proc.stdout
    assert losses_by_step(b) == losses_by_step(a)  # == on floats: bit for bit


# ---- export and import --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_hf(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base_hf") / "hf"
    convert(base, out, "hf")
    return out


@pytest.mark.slow
def test_peft_export_loads_in_peft_with_ember_logits(lora_run, base_hf, tmp_path):
    import peft  # the test extra installs it: never skipped
    from transformers import AutoModelForCausalLM

    out, _, _ = lora_run
    proc = run_ember("convert", str(out), str(tmp_path / "adapter"), "--to", "peft", env=job_env())
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    hf_base = AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32).eval()
    tokens = _tokens()
    with torch.no_grad():
        base_logits = hf_base(tokens).logits
        model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
        got = model(tokens).logits
        expected = load_model(out)(tokens)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapters change the logits: the match is not the base's
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_ember_logits(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _, _ = lora_run
    proc = run_ember("convert", str(out), str(tmp_path / "merged"), "--merge", env=job_env())
    assert proc.returncode == 0, proc.stderr
    assert not any("lora" in k for k in json.dumps(sorted(os.listdir(tmp_path / "merged"))))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, load_model(out)(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_peft_directory_is_its_base_with_the_adapter_folded_in(lora_run, base, tmp_path):
    out, _, _ = lora_run
    convert(out, tmp_path / "adapter", "peft")  # base_model_name_or_path: the ember base checkpoint
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "adapter")(tokens), load_model(out)(tokens),
                                   rtol=1e-5, atol=1e-5)
    # model.init_from=ADAPTER: training starts from the merged weights (architecture from the base)
    cfg = run_lib.load_config("debug", SHAPE + ["micro_batch_size=8", "max_steps=1", f"output_dir={tmp_path / 'ft'}",
                                            f"model.init_from={tmp_path / 'adapter'}"])
    trainer = Trainer(cfg)
    merged = load_model(out)
    merge_lora(merged)
    for key, tensor in merged.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
def test_an_adapter_for_another_base_is_one_line(lora_run, tmp_path):
    out, _, _ = lora_run
    convert(out, tmp_path / "adapter", "peft")
    other = tmp_path / "other"  # a base with 8 K/V heads: k_proj / v_proj have other shapes
    cfg = run_lib.load_config("debug", SHAPE + ["model.n_kv_heads=4", "micro_batch_size=8", "max_steps=1",
                                            f"output_dir={other}"])
    Trainer(cfg).train()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(other)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"an adapter for another base") as err:
        load_model(tmp_path / "adapter")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["lora.targets=nothing_here"], r"lora.targets entry 'nothing_here' matches no linear layer"),
    (["lora.targets=[wq,bogus]"], r"lora.targets entry 'bogus' matches no linear layer"),
    (["lora.rank=33", "lora.targets=wk"], r"lora.rank=33 exceeds layers.0.attention.wk \(32 x 64\)"),
    (["lora.rank=65"], r"lora.rank=65 exceeds"),
    (["lora.rank=-1"], r"lora.rank must be >= 0"),
    (["lora.dropout=1.0"], r"lora.dropout must be in \[0, 1\)"),
    (["lora.alpha=0"], r"lora.alpha must be a positive number"),
    (["lora.targets=3"], r"lora.targets=3: give all, attn, mlp"),
])
def test_bad_lora_config_is_one_line(base, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        run_lib.load_config("debug", SHAPE + LORA + ["micro_batch_size=8", f"model.init_from={base}", *overrides])
    assert "\n" not in str(err.value)


def test_lora_needs_a_base_and_refuses_moe_experts():
    with pytest.raises(ConfigError, match=r"lora.rank > 0 adapts a trained base: set model.init_from"):
        run_lib.load_config("debug", SHAPE + LORA)
    from ember.models import MODELS

    for family in ("mixtral", "glam"):
        with torch.device("meta"):
            model = MODELS[family].model_cls(MODELS[family].flavors["debug"])
        for targets in ("all", "mlp", ["wq", "w2"]):
            with pytest.raises(ConfigError, match=rf"reaches {family}'s MoE experts.*use lora.targets=attn"):
                apply_lora(model, rank=4, alpha=8, targets=targets, family=family)
        assert len(apply_lora(model, rank=4, alpha=8, targets="attn", family=family)) == 4 * model.args.n_layers


def test_peft_export_of_a_full_run_is_refused(base, tmp_path):
    with pytest.raises(CheckpointError, match=r"--to peft writes a LoRA run's adapters"):
        convert(base, tmp_path / "x", "peft")


@pytest.mark.slow
def test_trained_norms_and_embeddings_are_saved_and_restored(base, tmp_path):
    trainer, _ = _lora_run(tmp_path / "run", base, "lora.train_norms=true", "lora.train_embeddings=true",
                           "lora.targets=attn", steps=2)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= trainable
    assert not any(".feed_forward." in n or n.endswith(("wq.weight", "wo.weight")) for n in trainable)
    before = load_model(base).state_dict()
    assert not torch.equal(trainer.model.state_dict()["norm.weight"], before["norm.weight"])
    tokens = _tokens()
    trainer.model.eval()
    with torch.no_grad(), _compute(trainer):
        assert torch.equal(load_model(tmp_path / "run")(tokens), trainer.model(tokens))
    with pytest.raises(CheckpointError, match=r"also trained embeddings or norms"):
        convert(tmp_path / "run", tmp_path / "adapter", "peft")


@pytest.mark.slow
def test_gpt_peft_export_fuses_qkv_into_c_attn(tmp_path):
    """GPT-2's fused c_attn: the q/k/v adapters become one of rank 3r (block-diagonal B) that peft applies
    with the same scaling; peft's logits equal ember's."""
    import peft  # the test extra installs it: never skipped
    from transformers import AutoModelForCausalLM

    gpt = ["model.family=gpt", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.vocab_size=512",
           "data.dataset=synthetic", "seq_len=32", "global_batch_size=8", "micro_batch_size=8", "logging_steps=1",
           "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false", "optim.lr=1e-2"]
    Trainer(run_lib.load_config("debug", gpt + ["max_steps=1", f"output_dir={tmp_path / 'base'}"])).train()
    convert(tmp_path / "base", tmp_path / "base_hf", "hf")
    Trainer(run_lib.load_config("debug", gpt + ["max_steps=3", "lora.rank=4", "lora.alpha=8",
                                                "lora.targets=[wq,wv,wo,w1]", f"model.init_from={tmp_path / 'base'}",
                                                f"output_dir={tmp_path / 'lora'}"])).train()
    convert(tmp_path / "lora", tmp_path / "adapter", "peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["attn.c_proj", "c_attn", "mlp.c_fc"] and config["fan_in_fan_out"]
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", dtype=torch.float32).eval()
    tokens = _tokens()
    with torch.no_grad():
        base_logits = hf_base(tokens).logits
        got = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(tokens).logits
        expected = load_model(tmp_path / "lora")(tokens)
        assert (expected - base_logits).abs().max() > 1e-3
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # and back: the adapter directory folded into its base by ember
        torch.testing.assert_close(load_model(tmp_path / "adapter")(tokens), expected, rtol=1e-5, atol=1e-5)
