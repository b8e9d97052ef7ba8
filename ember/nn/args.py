"""The hyper-parameters the shared decoder reads (DecoderArgs), which every family's args dataclass extends.

A family adds its own fields and answers, by overriding, what the decoder asks of every model: each layer's
attention span, which layers have experts or RoPE, its RoPE tables (a typed RopeConfig built from the family's
own fields), and the rules its sizes must keep (`validate`). The field names are a file format: checkpoints'
model.json store `dataclasses.asdict(args)`, and model.json is read key by key, so a field keeps its name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from ember.errors import ConfigError
from ember.nn.attention import AttentionSpan
from ember.nn.rope import RopeConfig


@dataclass(frozen=True, kw_only=True)
class DecoderArgs:
    """What nn/decoder.py builds a model from. A family redeclares a field to give it a default."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int  # the RoPE tables' (or the learned position table's) positions: no sequence is longer
    norm_eps: float
    tie_embeddings: bool  # the output projection reuses the token embedding matrix

    # `model.<key>` -> field, where the field is not named as the config key (GroupedQueryArgs' head_dim)
    CONFIG_KEYS: ClassVar[dict[str, str]] = {}
    # the floor of an int field where it is not 1 (models/checks.py: a default of 0 makes 0 the floor)
    AT_LEAST: ClassVar[dict[str, int]] = {}

    @property
    def kv_heads(self) -> int:
        """K/V heads: as many as query heads unless a family groups them (GroupedQueryArgs)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope(self) -> Optional[RopeConfig]:
        """The RoPE tables every RoPE layer rotates by; None: no rotary embedding (GPT's learned positions)."""
        return None

    @property
    def local_rope(self) -> Optional[RopeConfig]:
        """A second set of tables for the local layers where they have their own base (Gemma 3); None: none."""
        return None

    def layer_span(self, layer_id: int) -> Optional[AttentionSpan]:
        """Where layer `layer_id` attends locally (a sliding window, chunks); None: its whole causal context."""
        return None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s feed-forward is a mixture of experts."""
        return False

    @property
    def has_experts(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_moe_layer(i) for i in range(self.n_layers))

    def uses_rope(self, layer_id: int) -> bool:
        """Whether layer `layer_id` rotates q and k (Llama 4's NoPE layers do not)."""
        return self.rope is not None

    def validate(self) -> None:
        """The rules the sizes must keep together, after the floors (models/checks.py runs both wherever args are
        made: a run's config, a model.json read); one ConfigError naming the model.* key and a fix. A family
        extends it with its own rules and calls this one."""
        self.check_head_shape()

    def check_head_shape(self) -> None:
        """dim splits into n_heads heads of an even width (RoPE turns pairs), and the K/V heads group them."""
        if self.dim % self.n_heads or self.n_heads % self.kv_heads or self.head_dim % 2:
            raise _heads_misfit(self)

    def canonical(self) -> DecoderArgs:
        """The one form of these hyper-parameters where two spell the same model (see GroupedQueryArgs)."""
        return self


@dataclass(frozen=True, kw_only=True)
class GroupedQueryArgs(DecoderArgs):
    """A decoder with grouped-query attention, whose heads may be wider or narrower than dim / n_heads (Hugging
    Face's `head_dim`, MaxText's fixed 128)."""

    n_kv_heads: Optional[int] = None  # None: multi-head attention (as many K/V heads as query heads)
    # Each attention head's width where it is not dim / n_heads (the q/k/v projections are n_heads x head_dim wide)
    head_dim_override: Optional[int] = None  # set by `model.head_dim` (see CONFIG_KEYS)

    CONFIG_KEYS: ClassVar[dict[str, str]] = {"head_dim": "head_dim_override"}

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def check_head_shape(self) -> None:
        explicit = self.head_dim_override
        if explicit is not None and (explicit <= 0 or explicit % 2):
            raise ConfigError(f"model.head_dim={explicit} must be a positive even number (RoPE rotates pairs of it)")
        if (explicit is None and self.dim % self.n_heads) or self.n_heads % self.kv_heads or self.head_dim % 2:
            raise _heads_misfit(self)

    def canonical(self) -> GroupedQueryArgs:
        """A head width stated as what dim / n_heads gives is the derived one: one model, one form."""
        if self.head_dim_override is not None and self.head_dim_override * self.n_heads == self.dim:
            return replace(self, head_dim_override=None)
        return self


def _heads_misfit(args: DecoderArgs) -> ConfigError:
    return ConfigError(f"model.dim={args.dim} must split into model.n_heads={args.n_heads} heads of even size (or set "
                       f"model.head_dim), and n_heads must be a multiple of model.n_kv_heads={args.kv_heads}")
