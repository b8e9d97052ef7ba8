"""MLA decode speed: ember's generate() (the latent cache, attention in the absorbed form: ember/nn/mla.py) vs
transformers' DeepseekV3ForCausalLM.generate() (which caches the latent too, and expands it into every head's keys
and values at every step), on the same weights, batch 1.

A DeepSeek-V3-shaped model (MLA with its V3 head widths, YaRN, a dense first layer, grouped sigmoid routing, a
shared expert) at a small width, random weights drawn by transformers and loaded by ember. Both sides decode
greedily with EOS off; the first round checks that both produced the same tokens (the comparison is of equal work).
Decode seconds per token: (time for prompt + N tokens - time for prompt + 1 token) / (N - 1). Rounds alternate
between the contestants; the figure is the median over rounds.

    python benchmarks/mla_decode.py                         # prompts of 256 and 1024 tokens, 32 new tokens
    python benchmarks/mla_decode.py --prompts 128 --new-tokens 8 --rounds 1   # checks that it runs

Writes benchmarks/results/mla_decode-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from results_file import write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ember, run from anywhere

import transformers  # noqa: E402

from ember.generate import generate  # noqa: E402
from ember.model_io.load import load_model  # noqa: E402


class IdTokenizer:
    """Token ids as text ("5 17 3" <-> [5, 17, 3]): generate's tokenizer where the prompt is random ids."""
    eos_id = 1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)

CONFIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=8192, max_position_embeddings=4096, q_lora_rank=384, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=256, n_routed_experts=16,
              num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=1024, beta_fast=32, beta_slow=1, mscale=1.0,
                                   mscale_all_dim=1.0))


def _timed(run) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="also time ember's compiled decode step "
                             "(generate(compile=True), `ember generate --compile`)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where both models decode, in fp32 (default: cuda when there is one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)).eval()
    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        ours = load_model(Path(directory)).eval().to(args.device)
    hf_model.to(args.device)

    def run_hf(prompt: torch.Tensor, n: int) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist()

    def run_ours(prompt: torch.Tensor, n: int, compile: bool = False) -> list[int]:
        (result,) = generate(ours, IdTokenizer(), [prompt[0].tolist()], max_new_tokens=n, stop_at_eos=False,
                             compile=compile)
        return result.token_ids

    contestants = [("transformers", run_hf), ("ember", run_ours)]
    if args.compile:
        contestants.append(("ember compiled", lambda prompt, n: run_ours(prompt, n, compile=True)))

    rows = []
    for length in args.prompts:
        prompt = torch.randint(2, CONFIG["vocab_size"], (1, length),
                               generator=torch.Generator().manual_seed(length)).to(args.device)
        per_token: dict[str, list[float]] = {name: [] for name, _ in contestants}
        if args.compile:  # compiled for both timed lengths (the static cache's size) outside the timing
            run_ours(prompt, 1, compile=True), run_ours(prompt, args.new_tokens, compile=True)
        for round_ in range(args.rounds):
            for name, run in contestants:
                first, _ = _timed(lambda: run(prompt, 1))
                total, tokens = _timed(lambda: run(prompt, args.new_tokens))
                per_token[name].append((total - first) / (args.new_tokens - 1))
                if round_ == 0:
                    per_token.setdefault(f"{name} tokens", tokens)  # type: ignore[arg-type]
        for name, _ in contestants[1:]:
            assert per_token["transformers tokens"] == per_token[f"{name} tokens"], f"{name}'s decode differs"
        hf_s, ours_s = statistics.median(per_token["transformers"]), statistics.median(per_token["ember"])
        row = {"prompt": length, "new_tokens": args.new_tokens, "batch": 1,
               "transformers_ms_per_token": round(hf_s * 1e3, 2), "ember_ms_per_token": round(ours_s * 1e3, 2),
               "speedup": round(hf_s / ours_s, 2)}
        line = (f"prompt {length:5d}: transformers {hf_s * 1e3:8.2f} ms/token, ember {ours_s * 1e3:8.2f} ms/token, "
                f"{hf_s / ours_s:.2f}x")
        if args.compile:
            compiled_s = statistics.median(per_token["ember compiled"])
            row |= {"ember_compiled_ms_per_token": round(compiled_s * 1e3, 2),
                    "compiled_speedup": round(hf_s / compiled_s, 2)}
            line += f"; compiled {compiled_s * 1e3:8.2f} ms/token, {hf_s / compiled_s:.2f}x"
        rows.append(row)
        print(line)
    write_results("mla_decode", rows, args, transformers=transformers.__version__)


if __name__ == "__main__":
    main()
