"""The Llama 2 / 3 / 3.1 / 3.2 decoder as plain single-device PyTorch.

RMSNorm, rotary position embeddings in Meta's convention (ember/nn/decoder.py: consecutive pairs of each
head rotate together; Llama 3.1 frequency scaling), grouped-query attention through
F.scaled_dot_product_attention, SwiGLU feed-forward. The skeleton (embedding, blocks, norm, output, RoPE
tables, tying, init) is the shared Decoder; this file holds the Llama block. No parallelism and no I/O
here: parallelize.py holds the tensor-parallel plan, hf.py maps Hugging Face weights.
"""

from __future__ import annotations

from ember.models.llama.args import LlamaArgs
from ember.nn.decoder import Decoder, RMSNorm, TransformerBlock, num_params
from ember.nn.feed_forward import FeedForward

__all__ = ["Transformer", "num_params", "flops_per_token"]


class Transformer(Decoder):
    """tokens (B, T) -> logits (B, T, vocab_size): the shared Decoder with Llama blocks and RMSNorm."""

    def __init__(self, args: LlamaArgs):
        super().__init__(args, lambda i: TransformerBlock(i, args, FeedForward(args.dim, args.ffn_hidden_dim)),
                         lambda: RMSNorm(args.dim, args.norm_eps))


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM, Chowdhery et al. 2022, appendix B).

    6 N: forward (2) and backward (4) FLOPs per weight a token's activations are multiplied by. N is every
    parameter except the input embedding, which is a lookup; a tied embedding stays in N once, as the
    output projection's weight, since that matmul runs whether or not the matrix is shared. 12 L H Q T:
    the attention scores and weighted values (QK^T and AV), which no parameter counts.
    """
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.kv_heads)  # wq, wo; wk, wv
    ffn = 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    norms = 2 * args.dim
    n = args.n_layers * (attn + ffn + norms) + args.dim + args.vocab_size * args.dim  # + final norm, output
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
