"""`ember generate PATH --prompt TEXT [...]`: continue prompts with a trained model (KV-cache decoding,
ember/generate.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ember.errors import ConfigError
from ember.usage import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ember generate", description="Continue prompts with a trained model (KV-cache decoding). PATH: an ember "
        "run or checkpoint, an HF directory or an `ember convert --to torch` file, local or a URL (s3://...: read "
        "through a local cache; a run's newest committed checkpoint).")
    p.add_argument("path")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", help='a jsonl of {"prompt": ...} rows, decoded as one batch')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="finite, >= 0; 0: greedy. Default: greedy, or 1.0 when --top-k, --top-p or --seed is "
                   "given (these sample; with --temperature 0 they are an error)")
    p.add_argument("--top-k", type=int, default=None, help=">= 1: sample from the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="in (0, 1]: sample from the smallest set of tokens "
                   "holding this probability mass")
    p.add_argument("--seed", type=int, default=None, help="seed the sampling (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop at this string, not empty (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file (default: the run's own)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt, completion, token_ids")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (for long outputs)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="the weights' dtype. auto: bf16 on a GPU, and on a CPU where bf16 matmuls measured at "
                   "least 1.2x fp32's at this model's decode shapes (measured once per machine), else fp32")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if not args.prompt and not args.prompt_file:  # a usage error: the usage, then the line, on stderr
        p.usage_error("give --prompt TEXT or --prompt-file FILE.jsonl")
    return args


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from ember.generate import check_max_new_tokens, generate, prompt_ids, sampling_temperature, tokenizer_for
    from ember.hardware.cpu_rates import model_gemms
    from ember.hardware.device import choose_compute_dtype, cpu_runs_bf16_natively, pick_compute_dtype, pick_device
    from ember.model_io.load import load_model
    from ember.storage.cache import local_copy
    from ember.storage.location import check_input

    for key, value in (("path", args.path), ("--tokenizer", args.tokenizer), ("--prompt-file", args.prompt_file)):
        check_input(value, key)  # a URL: its bucket, credentials and object, before any work
    # Every argument is checked before anything is printed: a streamed prompt followed by an error would run
    # the two together on one line.
    sampling = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
                if value is not None]
    if args.temperature == 0 and sampling:  # said with the command's flags rather than the Python API's names
        raise ConfigError(f"--temperature 0 decodes greedily, so {' and '.join(sampling)} would have no effect; drop "
                          "--temperature to sample (at 1.0), or give a temperature above 0")
    temperature = sampling_temperature(args.temperature, args.top_k, args.top_p, args.seed, args.stop)
    check_max_new_tokens(args.max_new_tokens)
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += _read_prompts(local_copy(args.prompt_file, "--prompt-file"))
    device = pick_device(args.device)
    # On a CPU, auto is measured at this model's decode matmuls (a batch of rows each step), so the weights load
    # in fp32 first and are cast once the model's shapes are known; elsewhere they load in the chosen dtype.
    measure = args.precision == "auto" and device.type == "cpu"
    model = load_model(args.path, device=device, dtype=torch.float32 if measure else
                       pick_compute_dtype(args.precision, device))
    tokenizer = tokenizer_for(args.path, args.tokenizer)
    prompt_ids(model, tokenizer, prompts, args.max_new_tokens)  # each prompt fits max_seq_len with the new tokens
    # Said after every check that can fail: a refused command prints its one-line error and nothing before it.
    if measure:
        choice = choose_compute_dtype("auto", device, lambda: model_gemms(model, len(prompts)), training=False)
        model = model.to(choice.dtype)
        if choice.dtype == torch.bfloat16:
            print(f"note: bf16 weights on the CPU ({choice.reason}) (--precision fp32 for fp32)", file=sys.stderr)
    elif device.type == "cpu" and args.precision == "bf16" and not cpu_runs_bf16_natively():
        print("note: --precision bf16 on a CPU without bf16 matmul instructions (AVX512-BF16, AMX): torch emulates "
              "them, many times slower than fp32", file=sys.stderr)
    if args.temperature is None and temperature > 0:
        print(f"note: sampling at temperature {temperature} (--top-k/--top-p/--seed sample; --temperature sets it)",
              file=sys.stderr)
    stream = not args.json and len(prompts) == 1
    if stream:
        print(prompts[0], end="", flush=True)
    results = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       stop=args.stop, compile=args.compile,
                       on_text=(lambda row, piece: print(piece, end="", flush=True)) if stream else None)
    for result in results:
        if args.json:
            print(json.dumps({"prompt": result.prompt, "completion": result.completion, "token_ids": result.token_ids}))
        elif stream:
            print()
        else:
            print(f"{result.prompt}{result.completion}\n")
    return 0


def _read_prompts(path: Path) -> list[str]:
    """The "prompt" of every row of a jsonl file; errors name the file and line."""
    from ember.errors import DataError
    from ember.eval.tasks import read_rows

    prompts = [row["prompt"] for row in read_rows(str(path), "--prompt-file", ("prompt",))]
    if not all(isinstance(p, str) for p in prompts):
        raise DataError(f"--prompt-file '{path}': every \"prompt\" must be text")
    return prompts
