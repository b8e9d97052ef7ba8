"""One litgpt training run for benchmarks/peers.py, through litgpt's own pretraining entry point.

`litgpt.pretrain.setup(...)` is what `litgpt pretrain` calls: Fabric on one device, the model built by
pretrain.py, `torch.compile`d there (litgpt's pretraining has no eager mode), AdamW from the `optimizer`
argument, its gradient clipping and its learning-rate schedule. The model is a custom `litgpt.Config` of the asked
Llama shape; the data a `DataModule` of uniform random tokens defined here.

What peers.py reads: litgpt's own CSV logger (`logger_name="csv"`, flushed every iteration) writes a row per
iteration to OUT/logs/csv/version_0/metrics.csv, `iter_time` its seconds; this runner records litgpt's version
and the model's parameter count in OUT/peers.jsonl (common.py).

    .venv-peers/bin/python benchmarks/peers_runners/litgpt_run.py --dim 64 --n-layers 2 --n-heads 8 \
        --n-kv-heads 4 --vocab 512 --ffn-hidden 192 --batch 2 --seq 64 --steps 6 --out /tmp/lit
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import litgpt  # noqa: E402
import torch  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from common import parse_args, say  # noqa: E402  (this folder is not a package: runners run as scripts)

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}  # what pretrain.py's --precision calls them


class Tokens(Dataset):
    """`length` rows of seq_len + 1 uniform random tokens (pretrain.py cuts inputs and targets from each)."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab_size, (length, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class RandomTokens(DataModule):
    """Random-token data for litgpt's pretraining: enough training rows for the run, two validation batches for
    the sanity check pretrain.py runs before its first step."""

    def __init__(self, vocab_size: int, steps: int, seed: int) -> None:
        super().__init__()
        self.vocab_size, self.steps, self.seed = vocab_size, steps, seed
        self.batch_size, self.seq_len = 1, 1

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None,  # noqa: ANN001
                **kwargs) -> None:  # noqa: ANN003
        self.batch_size, self.seq_len = batch_size, max_seq_length

    def train_dataloader(self) -> DataLoader:
        rows = Tokens(self.vocab_size, self.seq_len, self.batch_size * self.steps, self.seed)
        return DataLoader(rows, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        rows = Tokens(self.vocab_size, self.seq_len, self.batch_size * 2, self.seed + 1)
        return DataLoader(rows, batch_size=self.batch_size, shuffle=False)


def model_config(run: argparse.Namespace) -> litgpt.Config:
    """The Llama block as litgpt spells it: pre-norm RMSNorm, SwiGLU (LLaMAMLP), full RoPE, GQA, no biases,
    untied embeddings, the vocabulary unpadded."""
    return litgpt.Config(
        name="peers-llama", block_size=run.seq, n_layer=run.n_layers, n_embd=run.dim, n_head=run.n_heads,
        n_query_groups=run.n_kv_heads, head_size=run.dim // run.n_heads, vocab_size=run.vocab,
        padded_vocab_size=run.vocab, norm_class_name="RMSNorm", norm_eps=run.norm_eps, parallel_residual=False,
        shared_attention_norm=False, rope_base=int(run.rope_theta), rotary_percentage=1.0,
        intermediate_size=run.ffn_hidden, bias=False, mlp_class_name="LLaMAMLP")


def param_count(config: litgpt.Config) -> int:
    """The parameters of pretrain.py's `GPT(config)`, counted as its `Total parameters` line counts them
    (litgpt.utils.num_parameters); built on the meta device, so that counting takes none of the run's memory."""
    from litgpt.model import GPT
    from litgpt.utils import num_parameters

    with torch.device("meta"):
        return num_parameters(GPT(config))


def main() -> int:
    run = parse_args()
    say("version", f"litgpt {version('litgpt')}")
    if run.mode == "eager":
        raise SystemExit("litgpt's pretrain.py always torch.compiles the model: there is no eager run to make")
    from litgpt.pretrain import setup

    config = model_config(run)
    say("params", param_count(config))

    # The final checkpoint's hyperparameters.yaml is litgpt's CLI parse of sys.argv (parser_config.py): the
    # command line `litgpt pretrain peers-llama` would have had, not this runner's flags.
    sys.argv = [sys.argv[0], "peers-llama"]
    setup(
        model_name="peers-llama",
        model_config=config,
        out_dir=Path(run.out),
        precision=PRECISIONS[run.precision],
        data=RandomTokens(run.vocab, run.steps, run.seed),
        train=TrainArgs(
            save_interval=None, log_interval=1, global_batch_size=run.batch, micro_batch_size=run.batch,
            max_tokens=run.steps * run.batch * run.seq, max_norm=run.max_norm,
            lr_warmup_steps=0, min_lr=run.lr,  # constant lr: the cosine from lr down to lr
            tie_embeddings=False),
        eval=EvalArgs(interval=10**9, max_iters=2, initial_validation=False, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW",
                   "init_args": {"lr": run.lr, "weight_decay": run.weight_decay, "betas": tuple(run.betas),
                                 "eps": run.eps}},
        devices=1,
        logger_name="csv",  # the per-iteration metrics.csv peers.py reads
        seed=run.seed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
