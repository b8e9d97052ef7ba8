"""Generation with the KV cache: cached logits equal the full-sequence forward at every position, and greedy
decoding equals transformers' generate(do_sample=False) token for token on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ember.errors import ConfigError
from ember.generate import attach_kv_caches, detach_kv_caches, generate
from ember.model_io.convert import save_hf
from ember.models import MODELS, build_model_args
from tests.helpers import TINY_RUN, IdTokenizer, run_ember

SMALL = {"n_layers": 2, "dim": 64, "n_heads": 4, "vocab_size": 256, "max_seq_len": 64}
FAMILIES = {"llama3.1": {**SMALL, "n_kv_heads": 2}, "mixtral": {**SMALL, "n_kv_heads": 2, "ffn_hidden_dim": 96,
                                                               "n_experts": 4},
            "gpt": {**SMALL, "ffn_hidden_dim": 256}, "glam": {**SMALL, "ffn_hidden_dim": 96, "n_experts": 4},
            # a window shorter than the 20 positions decoded, on every layer and on Qwen3's upper layer
            "mistral": {**SMALL, "n_kv_heads": 2, "ffn_hidden_dim": 96, "sliding_window": 6},
            "qwen3": {**SMALL, "n_kv_heads": 2, "ffn_hidden_dim": 96, "sliding_window": 6, "max_window_layers": 1}}


def _model(family: str) -> torch.nn.Module:
    args = build_model_args(family, "debug", FAMILIES[family])
    torch.manual_seed(0)
    model = MODELS[family].model_cls(args)
    model.init_weights()
    if family == "glam":  # GLaM's N(0, 1) tied embedding makes near-ties in greedy picks; smaller keeps them apart
        model.tok_embeddings.weight.data.mul_(0.1)
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_logits_equal_the_full_forward_at_every_position(family: str):
    model = _model(family)
    tokens = torch.randint(2, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # (3, 20, V)
        caches = attach_kv_caches(model, 3, 20)
        pad = torch.zeros(3, dtype=torch.long)
        steps = [model_step(model, caches, tokens[:, :8], torch.arange(8), pad)]  # prefill 8, then one at a time
        for t in range(8, 20):
            steps.append(model_step(model, caches, tokens[:, t:t + 1], torch.tensor([t]), pad))
        detach_kv_caches(model)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def model_step(model, caches, tokens, slots, pad):
    for cache in caches:
        cache.set_positions(slots, pad)
    return model(tokens, (slots[None, :] - pad[:, None]).clamp_min(0))


@pytest.mark.parametrize("family", ["llama3.1", "gpt", "mistral"])
def test_cached_logits_with_left_padding_equal_each_row_alone(family: str):
    # Right-aligned rows of a batch go through the masked path; each row's logits equal its unpadded forward.
    model = _model(family)
    rows = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 7)]
    tokens = torch.zeros(2, 12, dtype=torch.long)
    tokens[0], tokens[1, 5:] = rows[0], rows[1]
    pad = torch.tensor([0, 5])
    with torch.no_grad():
        caches = attach_kv_caches(model, 2, 14)
        prefill = model_step(model, caches, tokens, torch.arange(12), pad)
        step = model_step(model, caches, torch.tensor([[9], [9]]), torch.tensor([12]), pad)
        detach_kv_caches(model)
        for row, ids in enumerate(rows):
            full = model(torch.cat([ids, torch.tensor([9])])[None])[0]
            torch.testing.assert_close(prefill[row, -len(ids):], full[:-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(step[row, 0], full[-1], rtol=1e-4, atol=1e-4)


def test_prompts_of_different_lengths_batch_like_one_at_a_time():
    model = _model("llama3.1")
    prompts = ["5 9 13", "7 3 22 40 8 19 2", "100"]
    batched = generate(model, IdTokenizer(), prompts, max_new_tokens=6, stop_at_eos=False)
    for prompt, result in zip(prompts, batched):
        (alone,) = generate(model, IdTokenizer(), [prompt], max_new_tokens=6, stop_at_eos=False)
        assert result.token_ids == alone.token_ids and result.completion == alone.completion


@pytest.mark.parametrize("family", ["llama3.1", "mixtral", "gpt"])
def test_greedy_equals_transformers_generate(tmp_path: Path, family: str):
    model = _model(family)
    save_hf(model, model.args, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    prompt = torch.randint(2, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                           min_new_tokens=20)[0, 10:].tolist()
    (result,) = generate(model, IdTokenizer(), [prompt[0].tolist()], max_new_tokens=20, stop_at_eos=False)
    assert result.token_ids == expected and result.stop_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.1", "mistral"])
def test_a_compiled_decode_step_gives_the_same_tokens(family: str):
    import torch._dynamo

    model = _model(family)
    prompts = ["5 9 13 40", "7 3"]  # a padded batch: the static-shape masked path
    eager = generate(model, IdTokenizer(), prompts, max_new_tokens=8, stop_at_eos=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one decode graph, not one per length (a window too)
        compiled = generate(model, IdTokenizer(), prompts, max_new_tokens=8, stop_at_eos=False, compile=True)
    # GRPO's compiled rollouts: a cache longer than needed (its run's seq_len) and prompts of other lengths, under
    # one graph, with the same greedy tokens
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        others = ["5 9 13", "7 3 2 8 1"]
        longer = generate(model, IdTokenizer(), others, max_new_tokens=8, stop_at_eos=False, compile=True,
                          cache_len=24)
        longer_again = generate(model, IdTokenizer(), prompts, max_new_tokens=8, stop_at_eos=False, compile=True,
                                cache_len=24)
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    assert [g.token_ids for g in longer_again] == [g.token_ids for g in eager]
    assert [g.token_ids for g in longer] == [g.token_ids for g in generate(model, IdTokenizer(), others,
                                                                             max_new_tokens=8, stop_at_eos=False)]


def test_sampling_is_seeded_and_stops():
    model = _model("gpt")
    a = generate(model, IdTokenizer(), ["5 9"], max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                 stop_at_eos=False)
    b = generate(model, IdTokenizer(), ["5 9"], max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                 stop_at_eos=False)
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 12
    third = str(a[0].token_ids[2])
    (cut,) = generate(model, IdTokenizer(), ["5 9"], max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9,
                      seed=7, stop=[f" {third}"], stop_at_eos=False)
    assert cut.stop_reason == "stop" and f" {third}" not in cut.completion
    assert cut.completion == "".join(f" {t}" for t in cut.token_ids)


def test_sampling_options_without_a_temperature_sample_at_1():
    # top_k/top_p/seed ask for sampling: without a temperature they run at 1.0, not greedily (which ignored them).
    model = _model("gpt")
    kwargs = dict(max_new_tokens=12, top_k=20, top_p=0.9, stop_at_eos=False)
    implied = [generate(model, IdTokenizer(), ["5 9"], seed=seed, **kwargs)[0].token_ids for seed in (7, 8)]
    at_one = [generate(model, IdTokenizer(), ["5 9"], seed=seed, temperature=1.0, **kwargs)[0].token_ids
              for seed in (7, 8)]
    (greedy,) = generate(model, IdTokenizer(), ["5 9"], max_new_tokens=12, stop_at_eos=False)
    assert implied == at_one and implied[0] != implied[1] and greedy.token_ids not in implied


@pytest.mark.parametrize("options, message", [
    ({"top_p": 0.0}, "top_p=0.0 must be in (0, 1] (the probability mass sampled from; 1 keeps every token)"),
    ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1] (the probability mass sampled from; 1 keeps every token)"),
    ({"top_k": -1}, "top_k=-1 must be >= 1 (the number of most likely tokens sampled from); leave it out to sample "
                    "from every token"),
    ({"top_k": 0}, "top_k=0 must be >= 1"),
    ({"temperature": -1.0}, "temperature=-1.0 must be >= 0 (0: greedy, 1: the model's own distribution)"),
    ({"temperature": float("nan")}, "temperature=nan must be a finite number >= 0 (0: greedy, 1: the model's own "
                                    "distribution)"),
    ({"temperature": float("inf")}, "temperature=inf must be a finite number >= 0"),
    ({"top_p": float("nan")}, "top_p=nan must be in (0, 1]"),
    ({"top_p": float("inf")}, "top_p=inf must be in (0, 1]"),
    ({"temperature": 0.0, "top_k": 5, "seed": 1}, "temperature=0 decodes greedily, so top_k and seed would have no "
                                                  "effect; drop the temperature to sample (at 1.0), or give a "
                                                  "temperature above 0"),
    ({"stop": [""]}, "a stop string is empty: it would end every completion before its first token"),
])
def test_out_of_range_sampling_options_are_one_line(options: dict, message: str):
    with pytest.raises(ConfigError) as err:
        generate(_model("gpt"), IdTokenizer(), ["5 9"], max_new_tokens=4, **options)
    assert str(err.value).startswith(message)


def test_a_prompt_beyond_the_context_is_one_line():
    model = _model("gpt")  # learned positions: the table has max_seq_len rows
    with pytest.raises(ConfigError, match=r"a prompt of 60 tokens plus max_new_tokens=10 exceeds the model's "
                                          r"max_seq_len=64"):
        generate(model, IdTokenizer(), [" ".join(["5"] * 60)], max_new_tokens=10)


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the tensor-to-Python reads (`int(t)`, `bool(t)`, `t.item()`): each is a device sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_decoding_reads_no_scalar_from_the_device_per_layer(family: str):
    # The caches' end and padding come from generate's own Python counters, so the reads do not grow with the
    # layers or the steps (a GPU would sync at each); the MoE takes the grouped path with no per-layer read.
    reads = {}
    for n_layers in (2, 4):
        torch.manual_seed(0)
        args = build_model_args(family, "debug", {**FAMILIES[family], "n_layers": n_layers})
        model = MODELS[family].model_cls(args)
        model.init_weights()
        with _ScalarReads() as mode:
            generate(model.eval(), IdTokenizer(), [[5, 6, 7], [8, 9]], max_new_tokens=6, stop_at_eos=False)
        reads[n_layers] = mode.count
    assert reads[2] == reads[4] == 0, reads


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "run"
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=3", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_cli_json_output_and_errors(trained_run: Path, tmp_path: Path):
    import json

    from ember import load_model
    from ember.generate import tokenizer_for

    proc = run_ember("generate", str(trained_run), "--prompt", "def f(", "--prompt", "import", "--max-new-tokens", "5",
                     "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(", "import"] and all(len(r["token_ids"]) <= 5 for r in rows)
    # The same as the Python API on the run's own tokenizer (the embedded BPE its config.yaml names).
    expected = generate(load_model(trained_run), tokenizer_for(trained_run), ["def f(", "import"], max_new_tokens=5)
    assert [r["token_ids"] for r in rows] == [e.token_ids for e in expected]
    assert [r["completion"] for r in rows] == [e.completion for e in expected]
    proc = run_ember("generate", str(trained_run), "--prompt", "x " * 3000, "--max-new-tokens", "5")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "exceeds the model's max_seq_len" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    proc = run_ember("generate", str(trained_run), "--prompt-file", str(bad))
    assert proc.returncode == 2 and f"{bad} line 1 has no 'prompt' field" in proc.stderr
    # Sampling options without --temperature sample at 1.0, and say so; the Python API gives the same tokens.
    proc = run_ember("generate", str(trained_run), "--prompt", "def f(", "--max-new-tokens", "5", "--top-k", "50",
                     "--seed", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "note: sampling at temperature 1.0 (--top-k/--top-p/--seed sample; --temperature sets it)\n"
    (sampled,) = generate(load_model(trained_run), tokenizer_for(trained_run), ["def f("], max_new_tokens=5,
                          temperature=1.0, top_k=50, seed=3)
    assert json.loads(proc.stdout)["token_ids"] == sampled.token_ids
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    proc = run_ember("generate", str(not_a_model), "--prompt", "x")
    assert proc.returncode == 2 and "holds no model" in proc.stderr


@pytest.mark.slow
def test_cli_precision_auto_decodes_with_bf16_weights_on_a_bf16_cpu(trained_run: Path):
    """precision auto on a CPU with bf16 matmuls (EMBER_CPU_BF16=1): the weights load in bf16 (half the bytes
    every decoded token reads), and the tokens are the Python API's on bf16 weights; --precision fp32 opts out."""
    import json
    import os

    from ember import load_model
    from ember.generate import tokenizer_for

    env = dict(os.environ, EMBER_CPU_BF16="1")
    args = ("generate", str(trained_run), "--prompt", "def f(", "--max-new-tokens", "4", "--json")
    proc = run_ember(*args, env=env, expect=0)
    assert proc.stderr == ("note: bf16 weights on the CPU (EMBER_CPU_BF16=1 declares bf16 matmul instructions, not "
                           "measured) (--precision fp32 for fp32)\n")
    expected = generate(load_model(trained_run, dtype=torch.bfloat16), tokenizer_for(trained_run), ["def f("],
                        max_new_tokens=4)
    assert json.loads(proc.stdout)["token_ids"] == expected[0].token_ids
    proc = run_ember(*args, "--precision", "fp32", env=env, expect=0)
    assert proc.stderr == ""
    fp32 = generate(load_model(trained_run), tokenizer_for(trained_run), ["def f("], max_new_tokens=4)
    assert json.loads(proc.stdout)["token_ids"] == fp32[0].token_ids
    # A refused command prints its error alone: no bf16 note before it.
    proc = run_ember("generate", str(trained_run), "--prompt", "x " * 3000, env=env, expect=2)
    assert proc.stderr.count("\n") == 1 and "exceeds the model's max_seq_len" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fp32, bf16, dtype", [(3e11, 1.6e11, torch.float32), (2e11, 6e11, torch.bfloat16)])
def test_cli_precision_auto_measures_the_models_decode_matmuls(trained_run: Path, tmp_path: Path, monkeypatch,
                                                               capsys, fp32, bf16, dtype):
    """On a CPU with bf16 instructions, auto is measured at this model's forward GEMMs on a decode step's rows (one
    per prompt): an AVX512-BF16 Xeon without AMX (bf16 at 0.53x) keeps fp32 weights, an AMX CPU takes bf16."""
    from ember.commands import generate as generate_command
    from ember.hardware import cpu_rates, device

    monkeypatch.delenv("EMBER_CPU_BF16", raising=False)
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(device, "cpu_runs_bf16_natively", lambda: True)
    measured, loaded = [], []

    def fake(gemms, dtypes, training=True):
        measured.append((gemms, training))
        return {torch.float32: fp32, torch.bfloat16: bf16}

    monkeypatch.setattr(cpu_rates, "measure_gemm_rates", fake)
    import ember.generate as generate_lib

    real = generate_lib.generate

    def spy(model, *args, **kwargs):  # the dtype the command decodes in
        loaded.append(next(model.parameters()).dtype)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(generate_lib, "generate", spy)
    args = generate_command.parse([str(trained_run), "--prompt", "def f(", "--prompt", "x", "--max-new-tokens", "2",
                                   "--device", "cpu"])
    assert generate_command.run(args) == 0
    ((gemms, training),) = measured
    assert not training and {g.tokens for g in gemms} == {2}  # two prompts: a decode step's two rows
    assert loaded == [dtype]
    err = capsys.readouterr().err
    if dtype == torch.bfloat16:
        assert err.startswith("note: bf16 weights on the CPU (bf16 matmuls ran 3.00x fp32's at this model's shapes")
    else:
        assert "bf16" not in err


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "error: top_p=1.5 must be in (0, 1]"),
    (["--top-k", "-1"], "error: top_k=-1 must be >= 1"),
    (["--temperature", "-1"], "error: temperature=-1.0 must be >= 0"),
    (["--temperature", "nan"], "error: temperature=nan must be a finite number >= 0"),
    (["--temperature", "inf"], "error: temperature=inf must be a finite number >= 0"),
    (["--top-p", "nan"], "error: top_p=nan must be in (0, 1]"),
    (["--max-new-tokens", "0"], "error: max_new_tokens=0 must be >= 1"),
    (["--stop", ""], "error: a stop string is empty"),
])
def test_cli_refuses_out_of_range_sampling_options_before_loading(tmp_path: Path, flags: list, message: str):
    proc = run_ember("generate", str(tmp_path / "no-model-needed"), "--prompt", "x", *flags)
    assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.slow
def test_cli_checks_every_argument_before_printing(trained_run: Path):
    # A streamed prompt is printed before its completion: an argument refused after it ran into the error line.
    for flags, message in ((["--max-new-tokens", "0"], "error: max_new_tokens=0 must be >= 1\n"),
                           (["--max-new-tokens", "100000"], "error: a prompt of 3 tokens plus max_new_tokens=100000 "
                            "exceeds the model's max_seq_len=2048; shorten the prompt or lower max_new_tokens\n")):
        proc = run_ember("generate", str(trained_run), "--prompt", "the cat", *flags)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message)


def test_cli_without_a_prompt_prints_its_usage(tmp_path: Path):
    proc = run_ember("generate", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: ember generate [-h] [--prompt PROMPT]")
    assert proc.stderr.endswith("\nember generate: error: give --prompt TEXT or --prompt-file FILE.jsonl\n")


def test_cli_sampling_flags_beside_temperature_0_are_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Said with the command's flags, before any model is loaded (there is none here)."""
    from ember import cli

    for flags, named in ((["--top-k", "5"], "--top-k"), (["--top-p", "0.9", "--seed", "1"], "--top-p and --seed")):
        assert cli.main(["generate", str(tmp_path / "none"), "--prompt", "x", *flags, "--temperature", "0"]) == 2
        assert capsys.readouterr() == ("", f"error: --temperature 0 decodes greedily, so {named} would have no "
                                           "effect; drop --temperature to sample (at 1.0), or give a temperature "
                                           "above 0\n")


def test_the_cpu_sampler_draws_the_softmax_distribution_and_never_a_zero_probability_token():
    """The CPU path's inverse-CDF draw: over 40,000 seeded draws each token's frequency is its probability within
    5 standard deviations, tokens top_k cut (probability 0) never come, and a seed repeats the draws."""
    from ember.generate import _sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]]).repeat(40_000, 1)
    probs = torch.softmax(logits[0], -1)
    draws = _sample(logits, 1.0, None, None, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=6).double() / len(draws)
    sigma = (probs * (1 - probs) / len(draws)).sqrt()
    assert ((counts - probs).abs() < 5 * sigma + 1e-12).all(), (counts, probs)
    top = _sample(logits, 1.0, 3, None, torch.Generator().manual_seed(0))
    assert set(top.tolist()) == {0, 1, 4}  # the 3 likeliest; the others have probability 0
    assert torch.equal(top, _sample(logits, 1.0, 3, None, torch.Generator().manual_seed(0)))
