"""GRPO's speed: ember's `task=grpo` against TRL's GRPOTrainer (transformers generation, no vLLM), side by side in
one run, on the same Llama, tokenizer, group size, prompt and completion lengths, completions per step, dtype, AdamW
settings and threads: rollout (generation) tokens/s and whole-step time of each, and their ratios against issue 42's
targets (ember's rollout tokens/s >= 1.5x TRL's; its step time <= 1/1.3 of TRL's).

    python benchmarks/grpo_throughput.py                     # CPU: a debug-sized Llama, 16 completions of 128 tokens
    python benchmarks/grpo_throughput.py --threads 1 --note "machine shared with a test run"
    python benchmarks/grpo_throughput.py --device cuda       # a ~1B Llama in bf16 autocast, and ember's decode at 64
    python benchmarks/grpo_throughput.py --dry-run           # tiny, end to end in about a minute (the test's)

Equal work: one Llama config of transformers' with random weights, saved once as an HF directory (safetensors and a
word-level tokenizer, one token per word) that TRL loads by path and ember by model.init_from. EOS, pad and unk
cannot be sampled: embedding dimension 0 is 1.0 for every token, no attention or MLP output writes to it (so it
reaches the final norm positive), and those tokens' output rows are -1e4 on it alone, so their probabilities
underflow to 0 at every position. So every completion runs the full --new-tokens in both (checked at every step:
`full_length`), with no logits processor added to either. Prompts are random words, exactly --prompt-len tokens
each; the reward is the completion's fraction of distinct words (one Python function for both; it varies, so the
advantages are not 0). Both: beta 0 (no reference model), one iteration per rollout batch (so neither runs an
old-policy log-prob pass), loss dapo, clip 0.2, temperature 1 without top-k/top-p, every completion of a step in one
forward/backward, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) at a constant --lr, gradients clipped to norm
1, --precision (fp32 on a CPU; on cuda bf16 autocast over fp32 weights), no torch.compile, TRL's gradient
checkpointing off (its default is on; ember's is off), logging every step; each run a fresh process with the same
torch threads.

Timing. Rollout: ember's grpo/rollout_s from its metrics.jsonl (sampling, decoding to text, rewards, advantages, the
training rows); TRL's `_generate_and_score_completions` under a timer (tokenizing, generation, decoding, rewards,
advantages). Generation alone: ember's sample() (ember/finetune/grpo_rollout.py) and TRL's model.generate() under a
timer. Whole step: ember's step_time_s (data, rollout, forward/backward, clipping, optimizer step); TRL's from its
trainer's on_step_begin to on_step_end (the same span). The first --warmup steps are dropped and the median of the
rest taken; rounds alternate which framework runs first, and a figure is the median over rounds. Tokens/s counts
completion tokens. With --decode-batch (64 on cuda), ember's rollout sampler alone at that batch: prefill and decode
tokens/s, read as benchmarks/generate_throughput.py reads them. The CPU other processes took meanwhile is recorded
(`other_processes_cores`): a shared machine slows both frameworks, not always alike.

Writes benchmarks/results/grpo_throughput-<cpu|cuda>.json (--dry-run: grpo_throughput-dryrun-<cpu|cuda>.json, in a
temporary folder unless --out is given).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT, BENCHMARKS = Path(__file__).resolve().parents[1], Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCHMARKS)]  # this checkout's ember and results_file.py, run from anywhere
from results_file import write_results  # noqa: E402

TARGETS = {"rollout_tokens_per_s": 1.5, "step_speedup": 1.3}  # ember over TRL; TRL's step time over ember's
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size")  # of transformers' LlamaConfig; debug is ember's llama3 debug flavor
SHAPES = {name: dict(zip(FIELDS, values)) for name, values in {
    "tiny": (64, 192, 2, 4, 2, 512), "debug": (256, 704, 4, 8, 4, 8192), "1b": (2048, 8192, 16, 32, 8, 32768)}.items()}
DEFAULTS = {  # per device: shape, completions per step, group size, prompt and new tokens, steps, warmup, rounds
    "cpu": dict(shape="debug", batch=16, group_size=8, prompt_len=64, new_tokens=128, steps=8, warmup=2, rounds=2,
                decode_batch=0, precision="fp32"),
    "cuda": dict(shape="1b", batch=64, group_size=8, prompt_len=128, new_tokens=256, steps=6, warmup=2, rounds=1,
                 decode_batch=64, precision="bf16"),
    "dry-run": dict(shape="tiny", batch=4, group_size=2, prompt_len=8, new_tokens=8, steps=3, warmup=1, rounds=1,
                    decode_batch=4),
}
EOS, PAD = 1, 2  # the tokenizer's ids: 0 <unk>, 1 </s>, 2 <pad>, then the words (none of the three is sampled)
REWARD = "grpo_throughput:distinct_words"  # what ember's grpo.rewards imports (this file, by module name)


def distinct_words(prompt: str, completion: str, row: Any = None) -> float:
    """The reward both frameworks score: the completion's fraction of distinct words."""
    words = completion.split()
    return len(set(words)) / max(1, len(words))


# ---------------------------------------------------------------- the shared model, tokenizer and prompts
def build_inputs(folder: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The HF directory (random Llama that cannot emit EOS, and its tokenizer) and the prompts' jsonl."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = SHAPES[args.shape]
    torch.manual_seed(args.seed)
    config = LlamaConfig(**shape, max_position_embeddings=args.prompt_len + args.new_tokens, rope_theta=500000.0,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # the special tokens' logits: -1e4 x (a positive normed dimension 0) at every position
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:3] = 0.0
        model.lm_head.weight[:3, 0] = -1e4
    hf = folder / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf, safe_serialization=True)
    vocab = {"<unk>": 0, "</s>": EOS, "<pad>": PAD} | {f"w{i}": i for i in range(3, shape["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(hf)
    rng, prompts = random.Random(args.seed), folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, shape['vocab_size'])}"
                                                              for _ in range(args.prompt_len))}) + "\n"
                               for _ in range(args.batch // args.group_size * (args.steps + 1))))  # none repeats
    return hf, prompts


# ---------------------------------------------------------------- the workers (each its own process)
def _clock(cuda: bool) -> float:
    """time.perf_counter() once the GPU's queued work is done."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed(fn: Any, times: list[float], seen: list[Any], cuda: bool) -> Any:
    """fn with each call's seconds appended to `times` and its (args, kwargs, result) to `seen`."""
    def wrapper(*a: Any, **k: Any) -> Any:
        start = _clock(cuda)
        out = fn(*a, **k)
        times.append(_clock(cuda) - start)
        seen.append((a, k, out))
        return out
    return wrapper


def run_ember(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("decode_only"):
        return {"decode": ember_decode(spec)}
    import ember.finetune.grpo as grpo_module
    import ember.train.trainer as trainer_module
    from ember.cli import main

    trainer_module.Trainer._save_now = lambda self: None  # no final checkpoint (after the steps; minutes for a 1B)
    gen_times: list[float] = []
    calls: list[Any] = []
    grpo_module.sample = _timed(grpo_module.sample, gen_times, calls, spec["device"] == "cuda")
    out = Path(spec["folder"]) / "ember"
    argv = ["train", "debug", "task=grpo", f"model.init_from={spec['hf']}", f"data.dataset={spec['prompts']}",
            f"data.tokenizer={spec['hf']}/tokenizer.json", f"grpo.rewards=[{REWARD}]",
            f"grpo.group_size={spec['group_size']}", f"grpo.max_new_tokens={spec['new_tokens']}",
            "grpo.loss_type=dapo", "grpo.beta=0", "grpo.iterations=1", "grpo.clip_low=0.2", "grpo.clip_high=0.2",
            "grpo.temperature=1.0", f"global_batch_size={spec['batch']}", f"micro_batch_size={spec['batch']}",
            f"seq_len={spec['prompt_len'] + spec['new_tokens']}", f"max_steps={spec['steps']}", "logging_steps=1",
            f"precision={spec['precision']}", f"device={spec['device']}", "compile=false", f"seed={spec['seed']}",
            f"optim.lr={spec['lr']}", "optim.weight_decay=0", "optim.betas=[0.9,0.999]", "optim.eps=1e-8",
            "optim.max_grad_norm=1.0", "schedule.name=constant", "schedule.warmup_steps=0", "checkpoint.interval=0",
            "eval_interval=0", "metrics.console=false", "metrics.tensorboard=false", "resume=none",
            f"output_dir={out}"]
    if main(argv) != 0:
        raise SystemExit(f"ember train failed: ember {' '.join(argv)}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if "grpo/rollout_s" in r), key=lambda r: r["step"])  # one a step
    lengths = [r["grpo/completion_length"] for r in steps] + [r["grpo/completion_length_max"] for r in steps]
    import ember

    return {"framework": "ember", "version": ember.__version__, "step_s": [r["step_time_s"] for r in steps],
            "rollout_s": [r["grpo/rollout_s"] for r in steps], "update_s": [r["grpo/update_s"] for r in steps],
            "generate_s": gen_times, "prompt_tokens": sorted({len(p) for a, _, _ in calls for p in a[2]}),
            "full_length": bool(steps) and all(n == spec["new_tokens"] for n in lengths)
            and all(r["grpo/truncated"] == 1.0 for r in steps)}


def ember_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """ember's rollout sampler (grpo_rollout.sample, as GRPO calls it) at --decode-batch completions: prefill
    tokens/s from a one-token run, decode tokens/s from the rest of a full run; medians of 3 after a warm-up."""
    from ember import load_model
    from ember.data.tokenizer import load_tokenizer
    from ember.finetune.grpo_rollout import sample

    device, batch, group = torch.device(spec["device"]), spec["decode_batch"], spec["group_size"]
    model = load_model(spec["hf"], device, torch.float32)
    tokenizer = load_tokenizer(f"{spec['hf']}/tokenizer.json")
    bf16 = spec["precision"] == "bf16"
    autocast = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    ids = [tokenizer.encode(json.loads(line)["prompt"]) for line in Path(spec["prompts"]).read_text().splitlines()]
    ids = (ids * batch)[:batch // group]

    def run(new: int) -> float:
        start = _clock(device.type == "cuda")
        with autocast:
            out = sample(model, tokenizer, ids, group, max_new_tokens=new, temperature=1.0, seed=0,
                         cache_dtype=torch.bfloat16 if bf16 else None)
        if any(len(c) != new for c in out.completion_ids):
            raise SystemExit(f"ember's sampler stopped a completion before {new} tokens: the timing would be off")
        return _clock(device.type == "cuda") - start

    run(new := spec["new_tokens"])  # a warm-up
    prefill, total = (statistics.median(run(n) for _ in range(3)) for n in (1, new))
    return {"batch": batch, "prompt_len": spec["prompt_len"], "new_tokens": new,
            "prefill_tokens_per_s": batch * spec["prompt_len"] / prefill,
            "decode_tokens_per_s": batch * (new - 1) / (total - prefill) if total > prefill else None}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = spec["device"] == "cuda"
    args = GRPOConfig(
        output_dir=str(Path(spec["folder"]) / "trl"), per_device_train_batch_size=spec["batch"],
        num_generations=spec["group_size"], max_completion_length=spec["new_tokens"], loss_type="dapo", beta=0.0,
        num_iterations=1, epsilon=0.2, epsilon_high=0.2, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=spec["lr"], weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, max_steps=spec["steps"], logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not cuda, bf16=spec["precision"] == "bf16",
        gradient_checkpointing=False, disable_tqdm=True, seed=spec["seed"], dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32})
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    trainer = GRPOTrainer(model=spec["hf"], args=args, train_dataset=Dataset.from_list(rows), reward_funcs=lambda
                          prompts, completions, **_: [distinct_words(p, c) for p, c in zip(prompts, completions)])
    gen_times, rollout_times, step_s, gens, rollouts = [], [], [], [], []
    trainer.model.generate = _timed(trainer.model.generate, gen_times, gens, cuda)
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, rollout_times,
                                                     rollouts, cuda)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = _clock(cuda)

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_s.append(_clock(cuda) - self.start)

    trainer.add_callback(StepTimer())
    trainer.train()
    prompt_tokens = sorted({k["input_ids"].shape[1] for _, k, _ in gens})
    lengths = [n for _, _, out in rollouts for n in out["completion_mask"].sum(1).tolist()]
    generated = [out.shape[1] - k["input_ids"].shape[1] for _, k, out in gens]
    return {"framework": "trl", "version": trl.__version__, "step_s": step_s, "rollout_s": rollout_times,
            "generate_s": gen_times, "prompt_tokens": prompt_tokens,
            "full_length": bool(lengths) and all(n == spec["new_tokens"] for n in lengths + generated)}


WORKERS = {"ember": run_ember, "trl": run_trl}


# ---------------------------------------------------------------- the parent: rounds, figures, table, JSON
def cpu_seconds() -> Optional[tuple[float, float]]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its finished children), or
    None where /proc/stat is not there."""
    try:
        user, nice, system, _, _, irq, softirq = map(int, Path("/proc/stat").read_text().split("\n")[0].split()[1:8])
    except (OSError, ValueError):
        return None
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), own


def run_worker(name: str, spec: dict[str, Any], folder: Path, threads: int) -> dict[str, Any]:
    """One framework's run in a fresh process (its output in a log, shown if it fails)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_file, log = folder / f"{name}-spec.json", folder / f"{name}.log"
    spec_file.write_text(json.dumps(spec | {"folder": str(folder)}))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")]))
    with log.open("w") as f:
        code = subprocess.call([sys.executable, __file__, "--worker", name, "--spec", str(spec_file)], stdout=f,
                               stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{tail}\nthe {name} run failed (exit {code}); its log: {log}")
    return json.loads((folder / f"{name}-result.json").read_text())


def summarize(runs: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """One framework's row from its rounds: medians of the kept steps per round, then over rounds."""
    tokens, warmup = spec["batch"] * spec["new_tokens"], spec["warmup"]  # completion tokens a step (full_length)

    def median(key: str) -> float:
        return statistics.median(statistics.median(r[key][warmup:]) for r in runs)

    kept = [t for r in runs for t in r["step_s"][warmup:]]
    row = {"framework": runs[0]["framework"], "version": runs[0]["version"], "step_s": median("step_s"),
           "rollout_s": median("rollout_s"), "generate_s": median("generate_s")}
    row["rest_s"] = row["step_s"] - row["rollout_s"]  # forward/backward, clipping, optimizer step, bookkeeping
    row |= {"update_s": median("update_s")} if "update_s" in runs[0] else {}  # ember's forward/backward alone
    rates = {"rollout_tokens_per_s": tokens / row["rollout_s"], "generate_tokens_per_s": tokens / row["generate_s"]}
    return row | rates | {"completion_tokens_per_step": tokens, "prompt_tokens": runs[0]["prompt_tokens"],
                          "steps_timed": len(kept), "step_spread": max(kept) / min(kept),
                          "full_length": all(r["full_length"] for r in runs),
                          "step_s_all": [r["step_s"] for r in runs], "rollout_s_all": [r["rollout_s"] for r in runs]}


def report(args: argparse.Namespace, rows: list[dict[str, Any]], ratios: dict[str, float], met: dict[str, bool],
           decode: Optional[dict[str, Any]], others: Optional[float], shared: bool) -> None:
    shape = SHAPES[args.shape]
    print(f"\nGRPO, {args.device}, {args.threads} threads, {args.precision}; {args.shape} Llama ({shape['hidden_size']}"
          f" x {shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}), {args.batch} completions a step "
          f"({args.batch // args.group_size} prompts x {args.group_size}), prompt {args.prompt_len}, {args.new_tokens} "
          f"new tokens; median of {args.steps - args.warmup} steps after {args.warmup}, over {args.rounds} round(s)")
    print(f"{'framework':<10}{'step s':>9}{'rollout s':>11}{'rest s':>9}{'gen s':>8}{'rollout tok/s':>15}"
          f"{'gen tok/s':>11}{'spread':>8}{'full':>6}")
    for r in rows:
        print(f"{r['framework']:<10}{r['step_s']:>9.3f}{r['rollout_s']:>11.3f}{r['rest_s']:>9.3f}"
              f"{r['generate_s']:>8.3f}{r['rollout_tokens_per_s']:>15.0f}{r['generate_tokens_per_s']:>11.0f}"
              f"{r['step_spread']:>8.2f}{str(r['full_length']):>6}")
    words = {True: "met", False: "NOT met"}
    print(f"ember/TRL rollout tokens/s {ratios['rollout_tokens_per_s']:.2f}x (target >= "
          f"{TARGETS['rollout_tokens_per_s']}x: {words[met['rollout_tokens_per_s']]}); generation alone "
          f"{ratios['generate_tokens_per_s']:.2f}x; step time TRL/ember {ratios['step_speedup']:.2f}x (target >= "
          f"{TARGETS['step_speedup']}x: {words[met['step_speedup']]})")
    if decode:
        rate = decode["decode_tokens_per_s"]
        print(f"ember's rollout sampler at batch {decode['batch']}: prefill {decode['prefill_tokens_per_s']:.0f} "
              f"tokens/s, decode {f'{rate:.0f}' if rate else 'n/a'} tokens/s")
    if not all(r["full_length"] for r in rows):
        print("WARNING: some completions ended before --new-tokens: the two frameworks did unequal work")
    if others is not None:
        print(f"other processes used {others:.2f} CPU cores on average meanwhile"
              f"{' (a shared machine: both frameworks were slowed, maybe not alike)' if shared else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: the whole script in about a minute")
    parser.add_argument("--shape", choices=tuple(SHAPES))
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="fp32, or bf16 autocast (both frameworks)")
    for flag in ("batch", "group-size", "prompt-len", "new-tokens", "steps", "warmup", "rounds", "decode-batch"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--threads", type=int, help="torch threads of each framework (default: torch's own count)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a note kept in the JSON (e.g. what else ran on the machine)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", help="keep the model, runs and logs in this folder (default: a temporary one)")
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # a child: one framework's run
        spec = json.loads(args.spec.read_text())
        torch.set_num_threads(spec["threads"])
        (args.spec.parent / f"{args.worker}-result.json").write_text(json.dumps(WORKERS[args.worker](spec)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    for key, value in (DEFAULTS[args.device] | (DEFAULTS["dry-run"] if args.dry_run else {})).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)  # the workers' count, which write_results names the machine by
    if args.batch % args.group_size or args.group_size < 2 or args.decode_batch % args.group_size:
        parser.error("--group-size must be >= 2 and divide --batch and --decode-batch")
    if args.steps <= args.warmup or min(args.rounds, args.prompt_len, args.threads) < 1 or args.new_tokens < 2:
        parser.error("--steps must exceed --warmup; --rounds, --prompt-len, --threads >= 1; --new-tokens >= 2")
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="grpo-dry-run-")) if args.dry_run else BENCHMARKS / "results"
    started, before = time.perf_counter(), cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="grpo-throughput-") as tmp:
        folder = Path(args.work or tmp)
        hf, prompts = build_inputs(folder, args)
        spec = {key: getattr(args, key) for key in ("device", "batch", "group_size", "prompt_len", "new_tokens",
                                                    "steps", "warmup", "lr", "seed", "threads", "precision")}
        spec |= {"hf": str(hf), "prompts": str(prompts), "decode_batch": args.decode_batch}
        runs: dict[str, list[dict[str, Any]]] = {"ember": [], "trl": []}
        for round_ in range(args.rounds):
            for name in (("ember", "trl") if round_ % 2 == 0 else ("trl", "ember")):
                print(f"round {round_ + 1}/{args.rounds}: {name} ...", flush=True)
                runs[name].append(run_worker(name, spec, folder / f"{name}-{round_}", args.threads))
        decode = None
        if args.decode_batch:  # ember's rollout sampler alone at the decode batch
            print(f"ember's rollout sampler at batch {args.decode_batch} ...", flush=True)
            decode = run_worker("ember", spec | {"decode_only": True}, folder / "decode", args.threads)["decode"]
    wall, after = time.perf_counter() - started, cpu_seconds()
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall if before and after else None
    rows = [summarize(runs[name], spec) for name in ("ember", "trl")]
    ember_row, trl_row = rows
    ratios = {"rollout_tokens_per_s": ember_row["rollout_tokens_per_s"] / trl_row["rollout_tokens_per_s"],
              "generate_tokens_per_s": ember_row["generate_tokens_per_s"] / trl_row["generate_tokens_per_s"],
              "step_speedup": trl_row["step_s"] / ember_row["step_s"],
              "step_time_ratio": ember_row["step_s"] / trl_row["step_s"]}
    met = {key: ratios[key] >= target for key, target in TARGETS.items()}
    shared = others is not None and others > 0.25
    report(args, rows, ratios, met, decode, others, shared)
    notes = "; ".join(n for n in (args.note, "machine shared with other processes while it ran" if shared else "") if n)
    import transformers

    write_results("grpo_throughput-dryrun" if args.dry_run else "grpo_throughput", rows, args, trl=trl_row["version"],
                  transformers=transformers.__version__, ratios=ratios, targets=TARGETS, met=met, decode=decode,
                  other_processes_cores=others, shared_machine=shared, dry_run=args.dry_run, notes=notes or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
