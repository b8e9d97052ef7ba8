"""Training FLOPs per token of a decoder on the shared skeleton, from its per-layer weights (PaLM appendix B)."""

from __future__ import annotations

from typing import Any, Callable

from ember.nn.attention import scored_length


def decoder_flops_per_token(args: Any, seq_len: int, layer_weights: Callable[[int], float]) -> float:
    """6 N + 12 H Q sum over layers of T: N counts each weight a token is multiplied by (`layer_weights(i)` for layer
    i: its attention, the experts it is routed to, its norms; then the final norm and the output projection, not
    the embedding lookup), and each layer's T the keys its attention span leaves (nn/attention.py's scored_length).
    `args` needs n_layers, dim, vocab_size, n_heads, head_dim and `layer_span(i)`."""
    n = sum(layer_weights(layer) for layer in range(args.n_layers)) + args.dim + args.vocab_size * args.dim
    scored = sum(scored_length(args.layer_span(layer), seq_len) for layer in range(args.n_layers))
    return 6 * n + 12 * args.n_heads * args.head_dim * scored
