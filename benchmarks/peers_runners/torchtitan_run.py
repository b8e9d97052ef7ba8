"""One torchtitan training run for benchmarks/peers.py, through torchtitan's own entry point.

`torchtitan.train.main()` parses the command line with its ConfigManager (`--module M --config F` plus
`--section.key value` overrides), exactly as `torchrun ... -m torchtitan.train` does. The module is this file
(registered under MODULE), whose `peers_llama3` builds a Trainer.Config from torchtitan's own Llama 3 pieces
(`_build_llama3_layers`, the debug model's inits) at the asked shape; every setting with a command-line flag
(steps, batch, sequence, clipping, compile, mixed precision) is given as a flag.

torchtitan 0.3.0 does not run here as shipped; what this file changes at run time, without editing the
package, is recorded as a `patch` (common.say): torch 2.13's missing `torch.distributed.set_timeout`
(`patch_torch`), the Triton import of its MoE kernels (`stub_triton_kernels`, CPU torch has no triton), its
device choice, which takes a machine without an accelerator for CUDA (`patch_for_cpu`), and flex attention,
which has no backward on a CPU (`use_sdpa`). It runs as one process with the gloo backend.

What peers.py reads: the record torchtitan's MetricsProcessor makes of every step (log_freq=1; the one it hands
TensorBoard or W&B), written to OUT/metrics.jsonl by JsonlMetrics; `time_metrics/end_to_end(s)` is the time
between two logged steps. The parameter count (as torchtitan's `size: N total parameters` counts it), the
version and the patches go to OUT/peers.jsonl (common.py).

    .venv-peers/bin/python benchmarks/peers_runners/torchtitan_run.py --dim 64 --n-layers 2 --n-heads 8 \
        --n-kv-heads 4 --vocab 512 --ffn-hidden 192 --batch 2 --seq 64 --steps 6 --out /tmp/tt
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import types
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import append_jsonl, parse_args, say  # noqa: E402  (not a package: runners run as scripts)

MODULE = "peers_torchtitan_config"  # what --module names: this file, as registered in sys.modules
METRICS_FILE = "metrics.jsonl"  # benchmarks/peers_frameworks.py's TITAN_METRICS_FILE
RUN: argparse.Namespace  # the run asked for, read by peers_llama3 when torchtitan calls it


def patch_torch() -> None:
    """torch.distributed.set_timeout, which torchtitan calls after the first step, is not in torch 2.13: the
    same per-group setter under its private name."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout: timedelta, group=None) -> None:  # noqa: ANN001 (torch's ProcessGroup or None)
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout
        say("patch", "torch.distributed.set_timeout -> distributed_c10d._set_pg_timeout (not in torch "
                     f"{torch.__version__}; torchtitan sets the train timeout after step 1)")


def stub_triton_kernels() -> None:
    """torchtitan imports its MoE expert-parallel Triton kernels (minimal_async_ep/kernels.py, `import triton`) on
    every start; a CPU build of torch comes without triton. A dense Llama never calls them: the module is
    replaced by one whose every name raises if called. triton itself is not faked (torch's inductor asks
    whether it is there)."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def missing(attr: str):  # noqa: ANN202
        if attr.startswith("__"):  # module protocol (inspect asks every module for __file__)
            raise AttributeError(attr)

        def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError(f"{name}.{attr} needs triton, which this environment lacks")
        return kernel

    stub.__getattr__ = missing
    sys.modules[name] = stub
    say("patch", f"{name}: stubbed (imports triton at startup, which a CPU torch lacks; MoE expert-parallel "
                 "kernels only, never called by a dense Llama)")


def cpu_device_module() -> types.ModuleType:
    """torch.cpu plus what torchtitan asks of a device module and torch.cpu lacks or answers differently: a
    name, the machine's memory as capacity, no allocator statistics (logged as -0.00GiB), device index 0."""
    module = types.ModuleType("torchtitan_cpu_device")
    for name in ("device_count", "is_available", "synchronize", "set_device", "Stream",
                 "Event", "current_stream", "stream"):
        setattr(module, name, getattr(torch.cpu, name))
    module.current_device = lambda: 0  # an index, as barrier(device_ids=[...]) wants; torch.cpu says "cpu"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.get_device_name = lambda device=None: platform.processor() or platform.machine()
    module.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total)
    module.memory_stats = lambda device=None: {}
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


def patch_for_cpu() -> None:
    """torchtitan picks its device once, at import: `_get_available_device_type() or "cuda"`, so a machine
    without an accelerator is taken for CUDA. Every loaded torchtitan module's copy is pointed at the CPU."""
    cpu = cpu_device_module()
    patched = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            patched.append(name)
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu
    say("patch", f"device cpu: torchtitan's device_type 'cuda' (its fallback without an accelerator) -> 'cpu', "
                 f"device_module -> torch.cpu with memory stats stubbed, in {len(patched)} modules")


def use_sdpa(model) -> None:  # noqa: ANN001 (a Llama3Model.Config)
    """torchtitan's causal SDPA in place of the flex attention its Llama 3 layers are built with (the configs
    refuse attn_backend='sdpa'). On a CPU flex cannot train: "FlexAttention does not support backward on
    CPU". On CUDA it is kept the same, the kernel ember's SDPA runs too; random tokens have no documents,
    so flex's block-causal masks would be plain causal anyway."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    found = list(model.traverse(FlexAttention.Config))
    for _, _, parent, attr in found:
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    say("patch", f"attention: torchtitan's ScaledDotProductAttention (causal) in place of flex in {len(found)} "
                 "layers (flex has no backward on a CPU; its Llama 3 configs refuse attn_backend='sdpa')")


def peers_llama3():  # noqa: ANN201 (torchtitan's Trainer.Config; imported late, after the patches)
    """The Trainer.Config for RUN: torchtitan's Llama 3 blocks at RUN's shape, SDPA attention, random tokens,
    constant lr, no checkpoints, no validation, no activation checkpointing."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import TrainingConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_llama3_layers,
        _output_linear_init,
        model_registry,
    )
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.trainer import Trainer

    run = RUN
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=run.n_layers, dim=run.dim, n_heads=run.n_heads, n_kv_heads=run.n_kv_heads,
        hidden_dim=run.ffn_hidden, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=run.dim // run.n_heads, max_seq_len=run.seq, theta=run.rope_theta,
                                scaling="none"))
    model = Llama3Model.Config(
        dim=run.dim, vocab_size=run.vocab,
        tok_embeddings=Embedding.Config(num_embeddings=run.vocab, embedding_dim=run.dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=run.dim, eps=run.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=run.dim, out_features=run.vocab, param_init=_output_linear_init(run.dim)),
        layers=layers)
    for _, norm, _, _ in model.traverse(RMSNorm.Config):
        norm.eps = run.norm_eps
    use_sdpa(model)
    spec = model_registry("debugmodel")
    spec.model = model
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=run.out,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=run.vocab)),
        optimizer=default_adamw(lr=run.lr, betas=tuple(run.betas), eps=run.eps, weight_decay=run.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, min_lr_factor=1.0),  # constant lr
        training=TrainingConfig(local_batch_size=run.batch, seq_len=run.seq, steps=run.steps),
        tokenizer=NoTokenizer.Config(vocab_size=run.vocab),
        dataloader=RandomTokens.Config(vocab_size=run.vocab, seed=run.seed),
        metrics=JsonlMetrics.Config(log_freq=1, disable_color_printing=True,
                                    path=os.path.join(run.out, METRICS_FILE)),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
    )


def define_metrics_class() -> None:
    """JsonlMetrics, torchtitan's MetricsProcessor writing each step's record to a JSON-lines file, defined once
    torchtitan is imported (its Configurable base wires Config.build to the class). The console line rounds tps
    to an integer; the record has it, and the step's time, in full."""
    global JsonlMetrics
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor

    class JsonlLogger(BaseLogger):
        def __init__(self, path: str) -> None:
            self.path = path

        def log(self, metrics: dict, step: int) -> None:
            append_jsonl(self.path, {"step": step, **metrics})

    class JsonlMetrics(MetricsProcessor):
        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            path: str = ""

        def __init__(self, config: Config, **kwargs) -> None:  # noqa: ANN003 (MetricsProcessor's keywords)
            super().__init__(config, **kwargs)
            # with TensorBoard and W&B off, torchtitan's logger is a BaseLogger that drops every record
            self.logger = JsonlLogger(config.path)

        def log(self, step: int, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            if step == 1:  # the model is built by now: every parameter of it, as `size: N total parameters` counts
                say("params", sum(p.numel() for part in self.model_parts for p in part.parameters()))
            super().log(step, *args, **kwargs)


def define_data_classes() -> None:
    """RandomTokens (a torchtitan dataloader of uniform random tokens) and NoTokenizer, defined once torchtitan
    is imported (its Configurable base wires Config.build to the class)."""
    global RandomTokens, NoTokenizer
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class Tokens(IterableDataset):
        def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
            self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

        def __iter__(self):  # noqa: ANN204
            generator = torch.Generator().manual_seed(self.seed)
            while True:
                tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
                yield {"input": tokens[:-1]}, tokens[1:]

    class RandomTokens(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            vocab_size: int = 0
            seed: int = 0

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,  # noqa: ANN001
                     local_batch_size: int, snapshot_every_n_steps=None) -> None:  # noqa: ANN001
            super().__init__(Tokens(config.vocab_size, seq_len, config.seed + dp_rank), dp_rank=dp_rank,
                             dp_world_size=dp_world_size, batch_size=local_batch_size)

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config: Config, tokenizer_path=None) -> None:  # noqa: ANN001
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:  # noqa: ANN002, ANN003
            raise NotImplementedError("random tokens: nothing to encode")

        def decode(self, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
            raise NotImplementedError("random tokens: nothing to decode")

        def get_vocab_size(self) -> int:
            return self.vocab_size


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    global RUN
    RUN = parse_args()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    patch_torch()
    stub_triton_kernels()
    import torchtitan
    import torchtitan.train

    if RUN.device == "cpu":
        patch_for_cpu()
    define_data_classes()
    define_metrics_class()
    say("version", f"torchtitan {getattr(torchtitan, '__version__', 'unknown')}")
    sys.modules[MODULE] = sys.modules[__name__]
    argv = ["--module", MODULE, "--config", "peers_llama3", "--dump-folder", RUN.out,
            "--training.mixed-precision-param", "bfloat16" if RUN.precision == "bf16" else "float32",
            "--training.max-norm", str(RUN.max_norm), "--debug.seed", str(RUN.seed)]
    if RUN.mode == "compiled":
        argv += ["--compile.enable"]
    sys.argv = [sys.argv[0]] + argv
    say("argv", " ".join(argv))
    torchtitan.train.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
