"""The fused cross-entropy equals F.cross_entropy (loss and gradients), chunked or not, in fp32 and bf16,
with ignored labels; it leaves the logits alone when no gradient is needed; the chunked model output
equals the whole one."""

import pytest
import torch
import torch.nn.functional as F

from ember.constants import IGNORE_INDEX
from ember.models import build_model_args
from ember.models.llama import Transformer
from ember.nn.loss import cross_entropy_sum, linear_cross_entropy_sum, output_chunks


def _reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (h @ w.t()).flatten(0, 1).float()
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunks", [1, 3])
def test_loss_and_gradients_equal_cross_entropy(dtype, tol, chunks):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :4] = IGNORE_INDEX  # e.g. an SFT prompt
    logits = h @ w.t()
    if chunks > 1:
        logits = [h_part @ w.t() for h_part in h.tensor_split(chunks, dim=1)]
    ours = cross_entropy_sum(logits, labels)
    (ours * 0.5).backward()
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    expected = _reference(h, w, labels)
    (expected * 0.5).backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got_h.float(), h.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_w.float(), w.grad.float(), rtol=tol, atol=tol)
    assert got_h[0, :4].abs().sum() == 0  # ignored positions get no gradient


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunks, softcap", [(1, None), (4, None), (3, 7.5)])
def test_linear_cross_entropy_equals_projection_then_cross_entropy(dtype, tol, chunks, softcap):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 9, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[1, :5] = IGNORE_INDEX
    ours = linear_cross_entropy_sum(h, w, labels, scale=0.25, chunks=chunks, softcap=softcap)
    (ours * 2.0).backward()  # a factor other than 1 reaches backward
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = (h @ w.t()).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") * 0.25
    (expected * 2.0).backward()
    assert ours.dtype == torch.float32 and got_h.dtype == dtype and got_w.dtype == dtype
    torch.testing.assert_close(ours, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got_h.float(), h.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_w.float(), w.grad.float(), rtol=tol, atol=tol)
    assert got_h[1, :5].abs().sum() == 0


def test_linear_cross_entropy_under_autocast_and_without_gradients():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 8, 16, generator=g).requires_grad_()
    w = torch.randn(40, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 40, (3, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy_sum(h, w, labels, chunks=2)
        expected = cross_entropy_sum(F.linear(h, w), labels)  # the unfused path under the same autocast
    ours.backward()
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    expected.backward()
    assert got_h.dtype == got_w.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-2, atol=1e-2)
    # bf16 products: the fused weight gradient rounds per chunk, the unfused one once
    torch.testing.assert_close(got_h, h.grad, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(got_w, w.grad, rtol=2e-2, atol=1e-2)
    # A frozen output matrix (LoRA without train_embeddings) gets no gradient; without grad, only the loss.
    w_frozen = w.detach()
    h.grad = None
    linear_cross_entropy_sum(h, w_frozen, labels, chunks=3).backward()
    torch.testing.assert_close(h.grad, torch.autograd.grad(cross_entropy_sum(F.linear(h, w_frozen), labels), h)[0])
    with torch.no_grad():
        value = linear_cross_entropy_sum(h, w, labels, chunks=5)
    assert float(value) == pytest.approx(float(cross_entropy_sum(F.linear(h, w), labels)), rel=1e-5)


def test_no_grad_leaves_logits_untouched_and_grad_reuses_them():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    before = logits.clone()
    with torch.no_grad():
        value = cross_entropy_sum(logits, labels)
    assert torch.equal(logits, before)
    assert value == pytest.approx(float(F.cross_entropy(before.flatten(0, 1), labels.flatten(), reduction="sum")),
                                  rel=1e-6)
    # With a gradient to compute, fp32 logits become that gradient in place (no second (N, V) buffer).
    leaf = before.clone().requires_grad_()
    logits = leaf * 1.0
    cross_entropy_sum(logits, labels).backward()
    torch.testing.assert_close(logits, leaf.grad)


def test_chunked_model_output_equals_whole():
    args = build_model_args("llama3", "debug", {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    whole = model(tokens)
    chunks = model(tokens, chunks=5)  # uneven: tensor_split gives 5, 5, 5, 5, 4 positions
    assert [c.shape[1] for c in chunks] == [5, 5, 5, 5, 4]
    torch.testing.assert_close(torch.cat(chunks, dim=1), whole)


def test_output_chunks_target_sizes():
    assert output_chunks(8, 256, 8192, "cpu") == 4  # 2048 x 8192 logits in chunks of 512 positions
    assert output_chunks(1, 64, 128, "cpu") == 1
    assert output_chunks(1, 8192, 128256, "cuda") == 4  # Llama 3 at 8K: 1 GiB fp32 chunks
    # a large vocabulary on the CPU: as few chunks as memory allows, never under 512 tokens each
    assert output_chunks(8, 256, 128256, "cpu") == 1
    assert output_chunks(8, 8192, 128256, "cpu") == 31  # 2,093 tokens (~1 GiB of logits) per chunk
    assert output_chunks(1, 4, 10**9, "cpu") == 1
    assert output_chunks(2, 4096, 8192, "cpu") == 16
    assert output_chunks(256, 4, 8192, "cpu") == 2  # 1,024 tokens
    assert output_chunks(1024, 4, 8192, "cpu") == 4  # 4,096 tokens, but never more chunks than positions
    # Fused with the projection: a chunk's logits are transient, ~64M of them (256 MiB fp32) per CPU chunk.
    assert output_chunks(8, 256, 8192, "cpu", fused=True) == 1
    assert output_chunks(8, 256, 128256, "cpu", fused=True) == 4
    assert output_chunks(8, 512, 32000, "cpu", fused=True) == 2
    assert output_chunks(1024, 4, 128256, "cpu", fused=True) == 8  # rows, not positions, bound the count
    assert output_chunks(1, 8192, 128256, "cuda", fused=True) == 4


def test_a_view_of_logits_is_not_modified_in_place():
    """Logits that are a view (tensor parallelism's gathered logits are) get a gradient buffer of their own."""
    base = torch.randn(2, 5, 22, requires_grad=True)
    logits = (base * 1.0)[..., :11]  # a view of a tensor autograd tracks
    labels = torch.randint(0, 11, (2, 5))
    cross_entropy_sum(logits, labels).backward()
    expected = base.detach().clone().requires_grad_()
    F.cross_entropy(expected[..., :11].flatten(0, 1), labels.flatten(), reduction="sum").backward()
    torch.testing.assert_close(base.grad, expected.grad)


@pytest.mark.parametrize("block_rows", [1, 4, 7, 64])
def test_bf16_logits_take_their_gradient_in_place_a_block_of_rows_at_a_time(block_rows, monkeypatch):
    """bf16 logits: each block of rows goes through one fp32 scratch and comes back as its gradient, so no
    (N, V) fp32 tensor exists; the loss and gradient are those of the whole-tensor fp32 computation, whatever
    the block size (whole blocks, a partial last block, one row at a time)."""
    import ember.nn.loss as loss_lib

    vocab = 37
    monkeypatch.setitem(loss_lib.BLOCK_BYTES, "cpu", block_rows * 4 * vocab)
    g = torch.Generator().manual_seed(0)
    leaf = (torch.randn(3, 6, vocab, generator=g) * 4).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (3, 6), generator=g)
    labels[1, :3] = IGNORE_INDEX
    logits = leaf * 1  # a non-leaf, not a view: the gradient may take its storage
    ours = cross_entropy_sum(logits, labels)
    (ours / 5).backward()
    assert torch.equal(logits, leaf.grad)  # the logits' own storage now holds the gradient
    reference_leaf = leaf.detach().float().requires_grad_()
    expected = F.cross_entropy(reference_leaf.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    (expected / 5).backward()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)  # fp32 arithmetic, only the sums' order differs
    # the gradient is kept in bf16 between forward and backward, then scaled (by 1/5, in fp32) and rounded again:
    # within bf16's rounding of the exact gradient
    torch.testing.assert_close(leaf.grad.float(), reference_leaf.grad, rtol=2**-7, atol=1e-6)
    assert leaf.grad[1, :3].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("upstream", [1.0, 3.0])
def test_scale_folds_into_the_loss_and_its_gradient(dtype, upstream, monkeypatch):
    """`scale` times the sum, with the gradient scaled in the forward: backpropagating the result (upstream 1,
    the trainer's case) or a multiple of it gives the reference gradient; several blocks of rows."""
    import ember.nn.loss as loss_lib

    vocab = 29
    monkeypatch.setitem(loss_lib.BLOCK_BYTES, "cpu", 3 * 4 * vocab)
    g = torch.Generator().manual_seed(1)
    leaf = (torch.randn(2, 7, vocab, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, 7), generator=g)
    labels[0, 2] = IGNORE_INDEX
    ours = cross_entropy_sum(leaf * 1, labels, scale=1 / 13)
    (ours * upstream).backward()
    reference_leaf = leaf.detach().float().requires_grad_()
    expected = F.cross_entropy(reference_leaf.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / 13
    (expected * upstream).backward()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(leaf.grad.float(), reference_leaf.grad, rtol=tol, atol=1e-6)
