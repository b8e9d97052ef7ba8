"""Which nn.Linear layers of a model's blocks `lora.targets` names: groups (all, attn, mlp), ember's module names
inside a block (wq, attention.wkv_a, feed_forward.w2) or the Hugging Face names peft's target_modules use (q_proj,
DeepSeek's q_a_proj, ...). Resolved on the model itself (a meta one at config time), so a mistake is one ConfigError
listing the names that family's blocks really have."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from torch import nn

from ember.errors import ConfigError

GROUPS = {"attn": ("attention",), "mlp": ("feed_forward", "moe")}  # block children each group covers
# Hugging Face module names users know from peft's target_modules (and `ember convert --to peft` writes) -> ember's
# names inside a block.
HF_ALIASES = {
    "q_proj": ("attention.wq",), "k_proj": ("attention.wk",), "v_proj": ("attention.wv",), "o_proj": ("attention.wo",),
    "gate_proj": ("feed_forward.w1",), "up_proj": ("feed_forward.w3",), "down_proj": ("feed_forward.w2",),
    "c_attn": ("attention.wq", "attention.wk", "attention.wv"), "c_fc": ("feed_forward.w1",),
    "c_proj": ("attention.wo", "feed_forward.w2"),
    # DeepSeek's Multi-head Latent Attention (q through its latent; the kv latent with the shared rope key)
    "q_a_proj": ("attention.wq_a",), "q_b_proj": ("attention.wq_b",), "kv_a_proj_with_mqa": ("attention.wkv_a",),
    "kv_b_proj": ("attention.wkv_b",),
}
# the entries that reach a MoE block's experts (stacked per expert, not nn.Linear)
_EXPERT_ENTRIES = ("mlp", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj", "c_fc")


def blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", None)
    for index, block in (layers.items() if layers is not None else []):
        yield f"layers.{index}", block


def _wanted(targets: Any) -> list[str]:
    """lora.targets as a list of entries: a group name or a module name."""
    if isinstance(targets, str):
        return ["attn", "mlp"] if targets == "all" else [targets]
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets):
        return [t for entry in targets for t in (["attn", "mlp"] if entry == "all" else [entry])]
    raise ConfigError(f"lora.targets={targets!r}: give all, attn, mlp, a module name (wq, feed_forward.w2, "
                      "q_proj) or a list of them")


def _matches(entry: str, name: str) -> bool:
    """Whether the module at `name` (inside a block, e.g. attention.wq) is what `entry` names."""
    if entry in GROUPS:
        return name.split(".", 1)[0] in GROUPS[entry]
    names = HF_ALIASES.get(entry, (entry,))
    return any(name == n or name.endswith("." + n) or name.startswith(n + ".") for n in names)


def _block_linears(model: nn.Module) -> list[str]:
    """The names (inside a block) of every nn.Linear the model's blocks hold, each once, in block order."""
    names: dict[str, None] = {}
    for _, block in blocks(model):
        names.update({name: None for name, module in block.named_modules() if isinstance(module, nn.Linear)})
    return list(names)


def _no_match(what: Any, model: nn.Module, family: str) -> ConfigError:
    """An entry that names nothing: the error lists the family's own module names and the HF names of them."""
    own = _block_linears(model)
    # one HF name per module, Llama's convention first (GPT-2's fused c_attn also matches, but is not their name)
    hf = {name: next((a for a, targets in HF_ALIASES.items() if targets == (name,)), None) for name in own}
    if any(name.endswith("experts") for _, block in blocks(model) for name, _ in block.named_modules()):
        hf = {name: alias for name, alias in hf.items() if alias not in _EXPERT_ENTRIES}  # refused: they reach experts
    return ConfigError(f"lora.targets entry '{what}' matches no linear layer of {family}'s blocks; choose all, attn, "
                       f"mlp or module names of its blocks: {', '.join(own)} "
                       f"(or as in HF: {', '.join(filter(None, hf.values()))})")


def resolve_targets(model: nn.Module, targets: str | Sequence[str], rank: int, family: str = "this model") -> list[str]:
    """The qualified names of the nn.Linear modules `targets` selects in `model`'s blocks, checked: every
    entry matches something, no entry reaches MoE experts, and `rank` fits every selected layer. Each
    mistake is a one-line ConfigError naming lora.targets or lora.rank."""
    entries = _wanted(targets)
    found: list[str] = []
    used = {entry: False for entry in entries}
    for prefix, block in blocks(model):
        for name, module in block.named_modules():
            hits = [entry for entry in entries if name and _matches(entry, name)]
            if hits and isinstance(module, nn.Linear):
                found.append(f"{prefix}.{name}")
                used.update({entry: True for entry in hits})
        has_experts = any(name.endswith("experts") for name, _ in block.named_modules())
        # feed_forward.* names a dense layer's linears only, so it adapts the dense layers between MoE ones (Llama 4)
        expert_hits = [e for e in entries if e in _EXPERT_ENTRIES]
        if has_experts and expert_hits:
            shown = "all" if targets == "all" else expert_hits[0]
            raise ConfigError(f"lora.targets={shown} reaches {family}'s MoE experts, which LoRA does not adapt "
                              "(stacked per expert, not nn.Linear); use lora.targets=attn, "
                              "plus feed_forward.w1/w2/w3 for dense layers")
    unused = [entry for entry, hit in used.items() if not hit]
    if unused or not found:
        raise _no_match(unused[0] if unused else targets, model, family)
    for name in found:
        out_features, in_features = linear(model, name).weight.shape
        if rank > min(in_features, out_features):
            raise ConfigError(f"lora.rank={rank} exceeds {name} ({out_features} x {in_features}): a rank above "
                              f"min(in, out) = {min(in_features, out_features)} adds nothing; lower lora.rank")
    return found


def linear(model: nn.Module, name: str) -> nn.Linear:
    return model.get_submodule(name)  # type: ignore[return-value]
