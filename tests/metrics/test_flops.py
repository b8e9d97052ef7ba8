"""Training FLOPs per token, pinned with arithmetic written out by hand (not the formula the code uses):
6 x the weights a token is multiplied by (PaLM appendix B: 2 forward + 4 backward), embedding lookups
excluded, norm gains and biases included as the docstrings say, plus 12 L H Dh T for attention scores
and weighted values. MFU is then that times tokens/s over the peak."""

from __future__ import annotations

import pytest
import torch

from ember.metrics.run_metrics import mfu
from ember.models.glam import GlamArgs, Transformer as GlamTransformer, flops_per_token as glam_flops
from ember.models.gpt import GPTArgs, Transformer as GPTTransformer, flops_per_token as gpt_flops
from ember.models.llama import LlamaArgs, Transformer as LlamaTransformer, flops_per_token as llama_flops
from ember.models.mixtral import MixtralArgs, Transformer as MixtralTransformer, flops_per_token as mixtral_flops

SEQ = 32
ATTENTION = 12 * 2 * 4 * 16 * SEQ  # layers 2, heads 4, head_dim 16, T 32: 49,152


def _active_weights(model_cls, args) -> int:
    """N read off the built model's own parameters, independent of flops_per_token: every parameter but the
    embedding lookups (a tied matrix counted once, as the output), experts scaled to the top_k a token uses.
    Equal to the hand count below, it also catches a model that gains a weight the formula forgets."""
    with torch.device("meta"):
        model = model_cls(args)
    n = 0
    for name, param in model.named_parameters():  # tied weights are listed once, under tok_embeddings
        if name.startswith("pos_embeddings"):
            continue  # learned positions: a lookup
        if name.startswith("tok_embeddings"):
            n += param.numel() if args.tie_embeddings else 0  # tied: it is the output projection's weight
        elif ".experts." in name:
            n += param.numel() * args.top_k // args.n_experts
        else:
            n += param.numel()
    return n


def test_llama():
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim_override=128,
                     max_seq_len=64)
    # per layer: wq 64x64 = 4,096; wk, wv 64x32 = 2,048 each; wo 4,096; w1, w2, w3 64x128 = 8,192 each;
    # two RMSNorm gains 64 each: 12,288 + 24,576 + 128 = 36,992; two layers 73,984;
    # final norm 64, output 256 x 64 = 16,384: N = 90,432
    assert llama_flops(args, SEQ) == 6 * 90_432 + ATTENTION == 591_744
    assert _active_weights(LlamaTransformer, args) == 90_432


def test_mixtral_counts_only_the_active_experts_and_the_router():
    args = MixtralArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96,
                       n_experts=4, top_k=2, max_seq_len=64)
    # per layer: attention 12,288 (as Llama's); 2 of 4 SwiGLU experts, 3 x 64 x 96 = 18,432 each: 36,864;
    # router 64 x 4 = 256; norms 128: 49,536; two layers 99,072; + 64 + 16,384: N = 115,520
    assert mixtral_flops(args, SEQ) == 6 * 115_520 + ATTENTION == 742_272
    assert _active_weights(MixtralTransformer, args) == 115_520


def test_gpt_counts_biases_and_layernorm_parameters():
    args = GPTArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, ffn_hidden_dim=256, max_seq_len=64)
    # per layer: wq, wk, wv, wo 64x64 + bias 64 each: 16,640; w1 64x256 + 256, w2 256x64 + 64: 33,088;
    # two LayerNorms, weight and bias: 256: 49,984; two layers 99,968; final LayerNorm 128, tied output
    # 16,384 (counted once, as the output matmul; the position table is a lookup): N = 116,480
    assert gpt_flops(args, SEQ) == 6 * 116_480 + ATTENTION == 748_032
    assert _active_weights(GPTTransformer, args) == 116_480


def test_glam_alternates_moe_and_dense_layers():
    args = GlamArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, ffn_hidden_dim=96, n_experts=4, top_k=2,
                    moe_every=2, max_seq_len=64)
    # both layers: attention 4 x 64 x 64 = 16,384, norms 128; layer 0 (MoE): 2 active two-matrix experts,
    # 2 x 2 x 64 x 96 = 24,576, router 256; layer 1 (dense gated GELU): 3 x 64 x 96 = 18,432;
    # final norm 64, tied output 16,384: N = 33,024 + 24,832 + 18,432 + 16,448 = 92,736
    assert glam_flops(args, SEQ) == 6 * 92_736 + ATTENTION == 605_568
    assert _active_weights(GlamTransformer, args) == 92_736


def test_mfu_is_achieved_over_peak():
    assert mfu(1000.0, 591_744, 1e9) == pytest.approx(0.591744)
    assert mfu(1000.0, 591_744, None) is None
