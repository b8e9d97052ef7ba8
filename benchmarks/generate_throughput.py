"""Generation speed: ember's KV-cache generate() vs transformers' generate() on the same weights.

Both sides decode greedily from the same random prompt, with EOS off so every run makes exactly
--new-tokens tokens. Prefill tokens/s is the prompt's forward alone (one call with max_new_tokens=1);
decode tokens/s is the remaining tokens over the remaining time. Rounds alternate between the contestants;
the figure per contestant is the median over rounds. The first round checks that both produced the same
tokens (so the comparison is of equal work).

    python benchmarks/generate_throughput.py                      # debug Llama and a ~100M Llama, batch 1 and 8
    (ember runs eager and with its decode step compiled: generate(..., compile=True))
    python benchmarks/generate_throughput.py --models debug --batch 1 --rounds 3
    python benchmarks/generate_throughput.py --ember-precision auto  # `ember generate`'s default dtype (bf16
        weights on a CPU with bf16 matmuls) against transformers' default (fp32 on CPU): tokens may then differ

Writes benchmarks/results/generate_throughput-<device>.json; with --ember-precision other than same,
generate_throughput-ember-<precision>-<device>.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ember.generate import generate
from ember.hardware.cpu_rates import model_gemms
from ember.hardware.device import choose_compute_dtype
from ember.model_io.convert import save_hf
from ember.models import MODELS, build_model_args
from results_file import write_results

MODELS_TO_RUN = {
    "debug": {},  # dim 256, 4 layers, vocab 8192: 7.1M parameters
    "100M": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 32000},  # ~110M
}


class Ids:
    """Token ids are the text: the benchmark times the model, not a tokenizer."""
    eos_id = -1

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="debug,100M")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ember-precision", default="same", choices=("same", "auto", "fp32", "bf16"),
                        help="ember's weights: same (transformers' dtype), or as `ember generate --precision`")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    # decode tokens/s is over the tokens after the first (the prefill's): it needs two
    if args.new_tokens < 2 or args.rounds < 1 or args.prompt_len < 1:
        parser.error("--new-tokens must be >= 2, --rounds and --prompt-len >= 1")
    if not all(b.isdigit() and int(b) > 0 for b in args.batch.split(",")):
        parser.error(f"--batch {args.batch}: comma-separated batch sizes, each >= 1")
    unknown = [m for m in args.models.split(",") if m not in MODELS_TO_RUN]
    if unknown:
        parser.error(f"--models {','.join(unknown)}: choose from {', '.join(MODELS_TO_RUN)}")
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in args.models.split(","):
        margs = build_model_args("llama3", "debug", MODELS_TO_RUN[name])
        torch.manual_seed(0)
        model = MODELS["llama3"].model_cls(margs)
        model.init_weights()
        # ember generate's own choice at this model's decode shapes (the first batch size's rows)
        first_batch = int(args.batch.split(",")[0])
        ember_dtype = dtype if args.ember_precision == "same" else choose_compute_dtype(
            args.ember_precision, device, lambda: model_gemms(model, first_batch), training=False).dtype
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(model, margs, tmp)
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=dtype).to(device).eval()
        model = model.to(device=device, dtype=ember_dtype).eval()
        model.init_rope(device)
        for batch in (int(b) for b in args.batch.split(",")):
            prompt = torch.randint(0, margs.vocab_size, (batch, args.prompt_len),
                                   generator=torch.Generator().manual_seed(1))

            def ember_run(new: int, compile: bool = False) -> list[list[int]]:
                out = generate(model, Ids(), prompt.tolist(), max_new_tokens=new, stop_at_eos=False, compile=compile)
                return [g.token_ids for g in out]

            def ember_compiled_run(new: int) -> list[list[int]]:
                return ember_run(new, compile=True)

            def hf_run(new: int) -> list[list[int]]:
                with torch.no_grad():
                    out = hf.generate(prompt.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)
                return out[:, args.prompt_len:].tolist()

            contestants = {"ember": ember_run, "ember compiled": ember_compiled_run, "transformers": hf_run}
            reference = hf_run(args.new_tokens)  # also the warm-up (and the compilation, below)
            same = all(run(args.new_tokens) == reference for run in (ember_run, ember_compiled_run))
            times = {n: {"prefill": [], "total": []} for n in contestants}
            for _ in range(args.rounds):
                for n, run in contestants.items():
                    for key, new in (("prefill", 1), ("total", args.new_tokens)):
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        run(new)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        times[n][key].append(time.perf_counter() - t0)
            result = {}
            for n in contestants:
                # each round's decode time is its whole run less its own prefill; where the machine made a
                # prefill outlast its whole run, no decode rate can be read from that round
                decode = statistics.median(t - p for t, p in zip(times[n]["total"], times[n]["prefill"]))
                result[n] = {"prefill_tokens_per_s": batch * args.prompt_len / statistics.median(times[n]["prefill"]),
                             "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode if decode > 0 else None}
            for n in contestants:
                decode, reference_decode = (result[n]["decode_tokens_per_s"],
                                            result["transformers"]["decode_tokens_per_s"])
                rows.append({"model": name, "batch": batch, "contestant": n, **result[n],
                             "decode_vs_transformers": (decode / reference_decode
                                                        if decode and reference_decode else None),
                             "prefill_vs_transformers": result[n]["prefill_tokens_per_s"]
                             / result["transformers"]["prefill_tokens_per_s"],
                             "same_tokens": same})
    print(f"\ngeneration, {platform.machine()} {device.type}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; weights: ember {ember_dtype}, "
          f"transformers {dtype}")
    print(f"{'model':<8}{'batch':>6}  {'contestant':<16}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode vs HF':>14}"
          f"{'same tokens':>13}")
    for r in rows:
        decode = f"{r['decode_tokens_per_s']:>14.1f}" if r["decode_tokens_per_s"] else f"{'n/a':>14}"
        ratio = f"{r['decode_vs_transformers']:>13.2f}x" if r["decode_vs_transformers"] else f"{'n/a':>14}"
        print(f"{r['model']:<8}{r['batch']:>6}  {r['contestant']:<16}{r['prefill_tokens_per_s']:>14.0f}"
              f"{decode}{ratio}{str(r['same_tokens']):>13}")
    if any(r["decode_tokens_per_s"] is None for r in rows):
        print("n/a: the prefill alone took as long as the whole run (a busy machine, or too few --new-tokens)")
    # A run with ember in another dtype than transformers is a comparison of its own, in a file of its own
    variant = "" if args.ember_precision == "same" else f"-ember-{args.ember_precision}"
    write_results(f"generate_throughput{variant}", rows, args, transformers=transformers.__version__,
                  ember_weights=str(ember_dtype).removeprefix("torch."),
                  transformers_weights=str(dtype).removeprefix("torch."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
