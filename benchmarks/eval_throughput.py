"""Eval speed: the same local lambada-style and boolq-style requests through ember's lm-eval adapter
(ember.eval.harness.EmberLM) and through lm-eval's own `hf` model on the HF export of the same weights.

Both score identical loglikelihood requests (checked equal to 1e-4 on the first round); wall time and
requests/s per contestant are the median of alternating rounds.

    python benchmarks/eval_throughput.py                  # debug Llama, 400 requests
    python benchmarks/eval_throughput.py --requests 200 --rounds 3

Writes benchmarks/results/eval_throughput-<device>.json. Needs the [eval] extra (lm-eval).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from results_file import write_results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    import transformers
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from ember.data.tokenizer import embedded_tokenizer
    from ember.eval.harness import EmberLM
    from ember.model_io.convert import save_hf
    from ember.models import MODELS, build_model_args

    tokenizer = embedded_tokenizer(8192, 0.02)
    margs = build_model_args("llama3", "debug", {})
    torch.manual_seed(0)
    model = MODELS["llama3"].model_cls(margs)
    model.init_weights()
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, margs, tmp)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok, eos_token="<|end_of_text|>")
    rng = random.Random(0)
    words = "the of and to in is that for it as with was on be by this are from or have an they which".split()
    requests = []
    for i in range(args.requests):  # half lambada-like (a passage, its last word), half boolq-like (yes/no)
        passage = " ".join(rng.choice(words) for _ in range(rng.randint(40, 120)))
        if i % 2:
            requests.append((passage, " " + rng.choice(words)))
        else:
            requests.append((f"{passage}\nQuestion: is it {rng.choice(words)}?\nAnswer:", rng.choice([" yes", " no"])))
    instances = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(requests)]
    contestants = {"ember": EmberLM(model, tokenizer, batch_size=args.batch_size),
                   "lm-eval hf": HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=args.batch_size,
                                      max_length=margs.max_seq_len)}
    first = {name: lm.loglikelihood(instances) for name, lm in contestants.items()}  # also the warm-up
    same = all(abs(a[0] - b[0]) <= 1e-4 for a, b in zip(first["ember"], first["lm-eval hf"]))
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(args.rounds):
        for name, lm in contestants.items():
            t0 = time.perf_counter()
            lm.loglikelihood(instances)
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"contestant": name, "seconds": t, "requests_per_s": len(requests) / t,
             "vs_lm_eval_hf": medians["lm-eval hf"] / t, "same_loglikelihoods": same} for name, t in medians.items()]
    print(f"\neval, {platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"debug Llama, {len(requests)} loglikelihood requests, batch {args.batch_size}")
    for r in rows:
        print(f"{r['contestant']:<12}{r['seconds']:>9.2f} s{r['requests_per_s']:>10.1f} req/s"
              f"{r['vs_lm_eval_hf']:>8.2f}x   same loglikelihoods: {same}")
    import lm_eval

    write_results("eval_throughput", rows, args, transformers=transformers.__version__, lm_eval=lm_eval.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
