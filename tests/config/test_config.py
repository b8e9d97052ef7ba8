"""Recipes, overrides and every config error: one line, naming the key and the fix."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember import config as config_lib
from ember.config import ConfigError
from ember.parallel.mesh_shape import fewest_ranks
from ember.train import run as run_lib
from tests.helpers import run_ember


def test_debug_recipe_defaults():
    cfg = run_lib.load_config("debug")
    assert cfg.model.family == "llama3" and cfg.model.flavor == "debug"
    assert cfg.data.dataset == "embedded"
    assert cfg.global_batch_size % cfg.micro_batch_size == 0


# recipes over files their user makes first, as docs/rl.md's chain does: they load once those exist
CHAIN_RECIPES = {"arith-sft": "arith/train.jsonl", "arith-grpo": "arith/train.jsonl"}  # the first file missing


def _load_every_recipe(names: list[str]) -> None:
    for name in names:
        # device=tpu|xla recipes: the schema's load only, since load_config asks jax for the devices
        # (tests/test_tpu_recipes.py checks their meshes)
        cfg = config_lib.load(name)
        if cfg.device not in config_lib.XLA_DEVICES:  # on the ranks its fixed axes need (an expert axis of 8: 8)
            run_lib.load_config(name, world_size=fewest_ranks(cfg.ici_mesh, cfg.dcn_mesh))


def test_every_builtin_recipe_loads(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no arith/ or outputs/ of a developer's own
    names = config_lib.recipe_names()
    for required in ("debug", "llama3-8b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "llama2-7b",
                     *CHAIN_RECIPES):
        assert required in names
    _load_every_recipe([name for name in names if name not in CHAIN_RECIPES])
    for name, missing in CHAIN_RECIPES.items():  # before the chain: the one line naming the file to make
        with pytest.raises(ConfigError, match=f"'{missing}' does not exist"):
            run_lib.load_config(name, world_size=1)
    cfg = run_lib.load_config("llama3.1-8b")
    assert (cfg.seq_len, cfg.global_batch_size) == (8192, 1024)


@pytest.mark.slow
def test_the_rl_chain_recipes_load_over_the_files_the_chain_makes(tmp_path: Path, monkeypatch):
    """docs/rl.md's commands, small: the gym data, its tokenizer, two SFT steps; then both recipes load."""
    gym = ["basic_arithmetic", "--option", "max_terms=2", "--option", "max_digits=2", "--option", "operators=[+]"]
    commands = [["data", "gym", *gym, "arith/train.jsonl", "--size", "200", "--seed", "1"],
                ["data", "tokenizer", "train", "arith/train.jsonl", "arith/tok", "--vocab-size", "260",
                 "--text-field", "prompt"],
                ["train", "arith-sft", "max_steps=2", "checkpoint.interval=2"]]
    for command in commands:
        run_ember(*command, cwd=tmp_path, expect=0)
    monkeypatch.chdir(tmp_path)
    _load_every_recipe(list(CHAIN_RECIPES))


def test_overrides_reach_nested_sections_and_cast_types():
    cfg = run_lib.load_config(
        "llama3.1-8b",
        ["global_batch_size=512", "seq_len=4096", "optim.lr=1e-4", "model.flavor=70B", "optim.betas=[0.9,0.99]"],
    )
    assert cfg.global_batch_size == 512 and cfg.seq_len == 4096
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.model.flavor == "70B" and list(cfg.optim.betas) == [0.9, 0.99]
    cfg = run_lib.load_config("debug", ["model.n_layers=2", "compile=true"])
    assert cfg.model.n_layers == 2 and cfg.compile is True
    assert config_lib.model_overrides(cfg.model) == {"n_layers": 2}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=3e-4"], "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["max_step=10"], "unknown config key 'max_step' (did you mean 'max_steps'?)"),
        (["optim.betas=abc"], "bad value for config key 'optim.betas': got 'abc' (expected list[float]: write "
                              "optim.betas=[A,B])"),
        (["precision=BF16"], "precision 'BF16' is not one of auto, fp32, bf16, fp8 (did you mean 'bf16'?)"),
        (["device=CPU"], "device 'CPU' is not one of auto, cpu, cuda, tpu, xla (did you mean 'cpu'?)"),
        (["model.remat=Full"], "model.remat 'Full' is not one of none, full, selective, op, offload "
                               "(did you mean 'full'?)"),
        (["eval.split=all"], "'eval.split' is a key of `ember eval` (the ppl window), not of training; training's "
                             "eval section has eval.tasks, eval.limit and eval.batch_size"),
        (["optim.lr=fast"], "config key 'optim.lr'"),
        (["max_steps=1.5"], "config key 'max_steps'"),
        (["global_batch_size=10", "micro_batch_size=4"], "global_batch_size=10 is not divisible by micro_batch_size"),
        (["seq_len=100000"], "seq_len=100000 exceeds the model's max_seq_len"),
        (["model.flavor=9B"], "unknown model.flavor '9B'"),
        (["model.family=gpt9"], "model.family"),
        (["precision=fp64"], "precision 'fp64'"),
        (["schedule.warmup_steps=-1"], "schedule.warmup_steps must be >= 0"),
        (["optim.lr"], "key=value"),
        (["output_dir=${oc.env:HF_TOKEN}"], "environment"),
        (["metrics.peak_tflops=0"], "metrics.peak_tflops=0.0: a device's peak TFLOP/s is a finite number > 0"),
        (["metrics.peak_tflops=nan"], "metrics.peak_tflops=nan: a device's peak TFLOP/s is a finite number > 0"),
        (["optim.betas=[0.9"], "cannot parse override 'optim.betas=[0.9': while parsing a flow sequence; close every"),
        (["eval.tasks={name:choice,data:x.jsonl}"], "override 'eval.tasks=...' has the wrong shape: a list is [a, b]"),
        (["data.num_workers=4"], "data.num_workers=4: 0 reads batches in the training thread, 1 in one"),
        (["data.prefetch=0"], "data.prefetch=0"),
    ],
)
def test_error_messages_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_wrong_type_names_value_and_expected_type():
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["optim.lr=fast"])
    text = str(info.value)
    assert "'fast'" in text and "expected float" in text
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["model.n_layers=two"])
    assert "expected int or null" in str(info.value)



@pytest.mark.parametrize("override, message", [
    ("model.vocab_size=abc", "bad value for config key 'model.vocab_size': got 'abc' (expected int or null)"),
    ("max_steps=1.5", "bad value for config key 'max_steps': got 1.5 (expected int)"),
    ("compile=maybe", "bad value for config key 'compile': got 'maybe' (expected bool)"),
    ("optim.betas=[a,b]", "bad value for config key 'optim.betas[0]': got 'a' (expected float)"),  # the item's type
])
def test_a_wrong_type_is_said_in_the_schemas_words_not_omegaconfs(override, message):
    # OmegaConf's text ("Value 'abc' of type 'str' could not be converted to Integer") names its own classes
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", [override])
    assert str(info.value) == message


def test_an_unknown_family_offers_the_closest_one():
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["model.family=gemma"])
    assert str(info.value).startswith("unknown model.family 'gemma' (did you mean 'gemma3'?); choose from llama2, ")
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("debug", ["model.family=xyz"])
    assert str(info.value).startswith("unknown model.family 'xyz'; choose from llama2, ")


def test_recipe_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="unknown recipe 'llama3.1-8B'.*did you mean 'llama3.1-8b'"):
        run_lib.load_config("llama3.1-8B")
    with pytest.raises(ConfigError, match="recipe file 'missing.yaml' not found"):
        run_lib.load_config("missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        run_lib.load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("optim:\n  lrr: 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr' \(did you mean 'optim.lr'\?\)"):
        run_lib.load_config(str(unknown))
    code = tmp_path / "code.yaml"
    code.write_text("seed: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        run_lib.load_config(str(code))


def test_saved_config_round_trips(tmp_path: Path):
    cfg = run_lib.load_config("debug", ["optim.lr=1e-3", "model.n_layers=2", "max_steps=7"])
    config_lib.save(cfg, tmp_path / "config.yaml")
    again = run_lib.load_config(str(tmp_path / "config.yaml"))
    assert again == cfg


@pytest.mark.slow
def test_cli_error_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "ember", "train", "debug", "optim.lrr=3e-4"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"
    assert "Traceback" not in proc.stderr


def test_llama_ffn_hidden_dim_is_settable_like_every_family():
    # It used to be a derived property for Llama only: the key was refused with a hint naming
    # ffn_hidden_dim_override, which was refused in turn as an unknown key.
    import torch

    from ember.models import MODELS, build_model_args

    cfg = run_lib.load_config("debug", ["model.ffn_hidden_dim=176"])
    args = build_model_args(cfg.model.family, cfg.model.flavor, config_lib.model_overrides(cfg.model))
    assert args.ffn_hidden_dim == 176
    with torch.device("meta"):
        model = MODELS[cfg.model.family].model_cls(args)
    assert model.layers["0"].feed_forward.w1.weight.shape == (176, args.dim)
    assert build_model_args("llama3", "debug").ffn_hidden_dim == 704  # Meta's rule when unset
    with pytest.raises(config_lib.ConfigError, match="unknown config key 'model.ffn_hidden_dim_override'"):
        run_lib.load_config("debug", ["model.ffn_hidden_dim_override=176"])


def test_output_dir_must_be_a_writable_directory(tmp_path: Path):
    # Found at config time, not after the model and data were built (it used to end in a traceback).
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"output_dir=.*notes\.txt is a file, not a directory"):
        run_lib.load_config("debug", [f"output_dir={a_file}"])
    with pytest.raises(ConfigError, match=r"notes\.txt is a file, so the directory cannot be created"):
        run_lib.load_config("debug", [f"output_dir={a_file}/run"])
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere; a read-only mount is the same case for it
        locked = Path("/proc/sys")
    with pytest.raises(ConfigError, match=r"is not writable; choose another output_dir"):
        run_lib.load_config("debug", [f"output_dir={locked}/run"])
    assert run_lib.load_config("debug", [f"output_dir={tmp_path}/new/run"]).output_dir.endswith("new/run")


def test_init_from_gives_the_family_and_only_a_command_line_family_can_contradict_it(tmp_path: Path):
    # docs/training-and-config.md: with model.init_from "the architecture is the source's (its config.json or
    # model.json), its family included: nothing to restate". A recipe's model.family (llama3.2-1b's llama3.2) is a
    # default the source (a llama3 run) replaces.
    from ember.model_io.convert import save_ember_checkpoint
    from ember.models import build_model_args
    from ember.models.llama import Transformer

    args = build_model_args("llama3", "debug", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2})
    step_dir = tmp_path / "source" / "checkpoints" / "step-1"
    save_ember_checkpoint(Transformer(args), "llama3", "debug", args, step_dir)
    common = ["data.dataset=synthetic", "seq_len=32", f"model.init_from={tmp_path / 'source'}"]
    cfg = run_lib.load_config("llama3.2-1b", common)
    choice = run_lib.model_choice(cfg)
    assert (cfg.model.family, choice.family, choice.flavor, choice.args) == ("llama3", "llama3", "debug", args)
    with pytest.raises(ConfigError) as info:
        run_lib.load_config("llama3.2-1b", [*common, "model.family=llama3.2"])
    assert str(info.value) == (f"model.family=llama3.2 but model.init_from {step_dir / 'model.json'} describes a "
                               "llama3 model; drop model.family (the architecture comes from model.init_from)")
    assert run_lib.load_config("llama3.2-1b", [*common, "model.family=llama3"]).model.family == "llama3"


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "llama4", "mixtral"])
@pytest.mark.parametrize("command", ["train", "plan"])
def test_hyper_parameters_the_loader_refuses_are_refused_before_any_work(tmp_path: Path, capsys, command, family):
    # model.top_k=0 trained with every step skipped (grad norm nan), exit 0, into a checkpoint the loader refused:
    # the loader's rules (ember/models/checks.py) now hold when a config is resolved, before output_dir is touched
    from ember.commands import run_command
    from ember.models import build_model_args

    out = tmp_path / "run"
    world = ["--world", "1"] if command == "plan" else []
    code = run_command(command, ["debug", *world, f"model.family={family}", "model.flavor=debug", "model.top_k=0",
                                 "max_steps=2", "seq_len=128", f"output_dir={out}"])
    flavor_top_k = build_model_args(family, "debug").top_k
    assert (code, capsys.readouterr().err) == (2, f"error: model.top_k=0 must be >= 1 (a size or a count); set "
                                                  f"model.top_k to 1 or more, or drop model.top_k (the flavor's is "
                                                  f"{flavor_top_k})\n")
    assert not out.exists()
