"""Cross-entropy over a large vocabulary, with its gradient computed in the forward pass.

`F.cross_entropy` runs log_softmax (one (N, V) tensor out), nll_loss, and in backward a zero-filled
(N, V) gradient for nll_loss plus log_softmax's backward (two more): four passes over, and three fresh
allocations of, a tensor the size of the logits. Here the forward makes one pass for the log-sum-exp
and one for the gradient, softmax - onehot, which backward only scales by the incoming scalar; the
logits themselves need not be kept. On a CPU the fresh (N, V) buffers cost page faults as much as the
arithmetic; `benchmarks/train_throughput.py` measures the effect of this and of chunking
(Decoder.output_chunks).

Written by hand because no library op fuses the gradient into the forward for plain tensors: the
fused kernels elsewhere (Liger, Apple's cut cross-entropy) are Triton/CUDA-only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake  # `ember plan` runs the step on fake tensors

from ember.constants import IGNORE_INDEX  # labels equal to it add nothing (SFT prompts, padding)


class _CrossEntropySum(torch.autograd.Function):
    """Forward: `scale` times the summed loss, and its gradient, scale * (softmax - onehot(target)), built a
    block of rows at a time (`_blockwise`). Logits that may be overwritten (not a view) become their gradient
    in place (marked dirty: nobody reads logits after the loss, and the output projection's backward needs
    only its inputs), so the loss allocates no (N, V) buffer; fresh buffers that size cost page faults on the
    CPU. The trainer backpropagates the scaled sum itself, so backward receives exactly 1 and leaves the
    gradient as it is: one pass over the logits fewer."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        # (B, T, V) -> (N, V): a view taken here, since autograd refuses a dirty input that is a view
        x, labels = logits.flatten(0, -2), labels.flatten()
        valid = labels != IGNORE_INDEX  # (N,)
        target = labels.clamp_min(0).unsqueeze(1)  # (N, 1); ignored rows read index 0, then are masked
        if not ctx.needs_input_grad[0]:
            return _blockwise(x, None, valid, target, scale), logits
        # autograd allows a dirty input only if it is not a view (tensor-parallel logits gathered over the
        # vocabulary are one); those get a buffer of their own
        in_place = not logits._is_view()
        grad = logits if in_place else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        loss = _blockwise(x, x if in_place else grad.view(x.shape), valid, target, scale)
        if in_place:
            ctx.mark_dirty(logits)
        ctx.save_for_backward(grad)
        return loss, grad

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _: None) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        # A factor of exactly 1 (the trainer's case; read without a device sync only on the CPU) leaves the
        # gradient alone. Otherwise scale in place: no fresh (N, V) buffer; the graph is backpropagated once.
        if grad_loss.device.type == "cpu" and not is_fake(grad_loss) and float(grad_loss) == 1.0:
            return grad, None, None
        return grad.mul_(grad_loss), None, None  # a bf16 gradient scaled in fp32 (a 0-dim fp32 factor), rounded once


# fp32 scratch per block of rows for low-precision logits: small enough to stay near the cache on a CPU (and
# be reused rather than page-faulted), large enough that a GPU runs few, large kernels.
BLOCK_BYTES = {"cpu": 8 << 20, "cuda": 512 << 20}
# The device whose block size applies, where it is not the logits' own: `ember plan` tracks a GPU run's step with
# fake CPU tensors, and the GPU's few large blocks are both what it must count and far fewer ops to trace.
_blocks_for: Optional[str] = None


@contextlib.contextmanager
def blocks_sized_for(device_type: str) -> Iterator[None]:
    """Inside: the blockwise loss uses `device_type`'s block size whatever device its logits are on."""
    global _blocks_for
    previous, _blocks_for = _blocks_for, device_type
    try:
        yield
    finally:
        _blocks_for = previous


def _blockwise(x: torch.Tensor, grad: Optional[torch.Tensor], valid: torch.Tensor, target: torch.Tensor,
               scale: float) -> torch.Tensor:
    """`scale` times the summed loss of logits x (N, V); with `grad` (N, V) (x itself, or a buffer of x's
    dtype), scale * (softmax - onehot) written there. A block of rows at a time: the block's passes (max,
    subtract, exp, sum, scale) run while it is in the cache, so the logits stream from memory about once
    rather than once per pass (over a whole 128K-vocabulary tensor each pass is memory-bound). fp32 rows are
    worked on where the gradient goes; other dtypes in one reused fp32 scratch, written back in their dtype,
    so no (N, V) fp32 tensor exists (4 GiB for 8K tokens of a 128K vocabulary). The arithmetic is fp32
    whatever the dtype: a bf16 log-sum-exp loses the small probabilities."""
    n_rows, vocab = x.shape
    rows = max(1, min(n_rows, BLOCK_BYTES.get(_blocks_for or x.device.type, 512 << 20) // (4 * vocab)))
    work_in_grad = grad is not None and grad.dtype == torch.float32
    scratch = None if work_in_grad else torch.empty((rows, vocab), dtype=torch.float32, device=x.device)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, n_rows, rows):
        end = min(n_rows, start + rows)
        ok, tgt = valid[start:end].unsqueeze(1), target[start:end]
        block = grad[start:end] if work_in_grad else scratch[: end - start]
        if not (work_in_grad and grad is x):  # fp32 logits turning into their gradient are worked on where they are
            block.copy_(x[start:end])
        target_logit = block.gather(1, tgt)
        row_max = block.amax(dim=-1, keepdim=True)
        row_sum = block.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
        loss += (row_max + row_sum.log() - target_logit).mul_(ok).sum()
        if grad is None:
            continue
        weight = ok * scale  # (rows, 1): zero on ignored rows
        block.mul_(weight / row_sum).scatter_add_(1, tgt, -weight)
        if not work_in_grad:
            grad[start:end].copy_(block)
    return loss * scale


def cross_entropy_sum(logits: Union[torch.Tensor, list[torch.Tensor]], labels: torch.Tensor,
                      scale: float = 1.0) -> torch.Tensor:
    """`scale` times the summed token cross-entropy of logits (B, T, V) against labels (B, T) (IGNORE_INDEX
    skipped), in fp32. Scaling here rather than after saves backward a pass over the logits. `logits` may also
    be the list of sequence chunks that `Transformer(output_chunks > 1)` returns; labels are split the same way
    (`tensor_split` along T)."""
    chunks = logits if isinstance(logits, (list, tuple)) else [logits]
    label_chunks = labels.tensor_split(len(chunks), dim=1) if len(chunks) > 1 else [labels]
    total = torch.zeros((), device=labels.device, dtype=torch.float32)
    for chunk, chunk_labels in zip(chunks, label_chunks):
        loss, _ = _CrossEntropySum.apply(chunk, chunk_labels, scale)
        total = total + loss
    return total


class _LinearCrossEntropySum(torch.autograd.Function):
    """The output projection and the loss in one: `scale` times the summed loss of logits h @ W^T (softcapped
    where the model caps them), a chunk of rows at a time. Each chunk's logits turn into their gradient in
    place (`_blockwise`), which goes at once into the gradients of h and of W (the two products the
    projection's backward would compute), so a chunk's logits are freed before the next one's exist: a
    micro-batch's (N, V) logits are never all in memory (1 GiB for 2K tokens of a 128K vocabulary in fp32).
    The FLOPs are the unfused path's. Backward only hands the two gradients on (scaled where the incoming
    factor is not exactly 1). Liger's and Apple's cut cross-entropy kernels do this in Triton, on GPUs only."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float,  # type: ignore[override]
                chunks: int, softcap: Optional[float]) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        x, labels = h.flatten(0, -2), labels.flatten()  # (N, D), (N,)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w: Optional[torch.Tensor] = None  # accumulated over the chunks in fp32 (or in W's own dtype if it is fp32)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)  # `scale` times the sum: _blockwise scales
        # The products in autocast's dtype where it is on, as the unfused path's linear; cast here once rather
        # than by autocast per chunk and again for the backward products (the output matrix is vocabulary-sized)
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        x_compute, w_compute = x.to(dtype), weight.to(dtype)
        for rows in _row_slices(x.shape[0], chunks):
            with torch.autocast(device_type, enabled=False):  # the rest in the dtypes chosen here
                x_rows = x_compute[rows]
                logits = F.linear(x_rows, w_compute)  # (n, V)
                cap_slope = None
                if softcap is not None:  # cap * tanh(z / cap): its slope 1 - tanh^2 scales the gradient
                    tanh = logits.div_(softcap).tanh_()
                    cap_slope = (1 - tanh * tanh) if (want_x or want_w) else None
                    logits = tanh.mul_(softcap)
                valid = labels[rows] != IGNORE_INDEX
                target = labels[rows].clamp_min(0).unsqueeze(1)
                if not (want_x or want_w):
                    loss += _blockwise(logits, None, valid, target, scale)
                    continue
                loss += _blockwise(logits, logits, valid, target, scale)
                grad = logits if cap_slope is None else logits.mul_(cap_slope)  # d (scale * loss) / d (h @ W^T)
                if want_x:
                    grad_x[rows] = torch.mm(grad, w_compute)
                if want_w:
                    if grad_w is None:
                        grad_w = torch.mm(grad.t(), x_rows).float()
                    elif grad.dtype == torch.float32:
                        grad_w.addmm_(grad.t(), x_rows)
                    else:
                        grad_w += torch.mm(grad.t(), x_rows)
            del logits, grad
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        ctx.grads = (grad_x.view(h.shape) if grad_x is not None else None, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor]):  # type: ignore[override]
        grad_x, grad_w = ctx.grads
        ctx.grads = None
        if grad_loss is None:
            return None, None, None, None, None, None
        if not (grad_loss.device.type == "cpu" and not is_fake(grad_loss) and float(grad_loss) == 1.0):
            grad_x = grad_x.mul_(grad_loss) if grad_x is not None else None
            grad_w = grad_w.mul_(grad_loss) if grad_w is not None else None
        return grad_x, grad_w, None, None, None, None


def _row_slices(n_rows: int, chunks: int) -> list[slice]:
    """`chunks` (at most n_rows) contiguous row ranges of nearly equal size covering 0..n_rows."""
    chunks = max(1, min(chunks, n_rows))
    bounds = [n_rows * i // chunks for i in range(chunks + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(chunks)]


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scale: float = 1.0,
                             chunks: int = 1, softcap: Optional[float] = None) -> torch.Tensor:
    """`scale` times the summed token cross-entropy of the logits h @ weight^T, capped at softcap * tanh(z /
    softcap) where softcap is set, against labels (IGNORE_INDEX skipped), in fp32, without ever holding all
    the logits: h (B, T, D) or (N, D), weight (V, D), labels h's leading shape; `chunks` row chunks. Both
    gradients are computed here (see _LinearCrossEntropySum); backpropagate the result itself. This is
    what Decoder(output_fn=...) calls in place of its output projection when the step fuses the two."""
    return _LinearCrossEntropySum.apply(h, weight, labels, scale, chunks, softcap)


def output_chunks(batch: int, seq_len: int, vocab_size: int, device_type: str, fused: bool = False) -> int:
    """How many chunks one micro-batch's logits are computed in: sequence chunks of the model's output
    (Decoder(chunks=...)), or, `fused`, row chunks of the loss fused with the output projection
    (linear_cross_entropy_sum).

    Every chunk re-reads the whole output matrix (forward, and both products of its backward) and is a
    matmul of its own, so chunks keep at least 512 tokens. Beyond that:
    - fused: a chunk's logits are freed before the next chunk's exist, so the chunk size is the logits'
      peak: about 64M logits (256 MiB in fp32) on a CPU, 256M on a GPU (large matmuls best). On a 2-core
      AVX512-BF16 EPYC under bf16 autocast, at 2048 tokens: 128K vocabulary in 4 chunks 1.63-1.71 s a step
      against 1.56-1.92 s for the unfused whole, 190-460 MiB less peak RSS; 8K in one chunk 0.30 s against
      0.31-0.36 s unfused in 4.
    - unfused, on CPU, vocabularies up to 16K: 512-token chunks (16-32 MiB of fp32 logits) beat the whole
      tensor: they come from the allocator's reused memory instead of fresh pages, and stay nearer the cache;
    - unfused, larger vocabularies and GPUs: every chunk's logits live until backward, so chunks only bound
      the transient of each: about 256M logits (1 GiB in fp32), e.g. 128K x 8192 tokens in four.
    """
    if fused:
        tokens_per_chunk = max(512, (1 << (26 if device_type == "cpu" else 28)) // vocab_size)
    elif device_type == "cpu" and vocab_size <= 16384:
        tokens_per_chunk = 512
    else:
        tokens_per_chunk = max(512, (1 << 28) // vocab_size)
    most = batch * seq_len if fused else seq_len  # fused chunks are of rows, the model's of positions
    return max(1, min(most, round(batch * seq_len / tokens_per_chunk)))
