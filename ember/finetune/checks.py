"""The config checks of the post-training tasks, task=dpo and task=grpo: each a ConfigError naming the keys, before
any work (ember.train.run.check runs them). grpo.* keys set for another task are refused rather than ignored."""

from __future__ import annotations

import math

from ember.config_schema import GRPOConfig, JobConfig
from ember.errors import ConfigError, not_one_of

SCALES = {"group": "group", "true": "group", "batch": "batch", "none": "none", "false": "none"}
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo")


def check(cfg: JobConfig) -> None:
    if cfg.task == "dpo":
        _check_dpo(cfg)
    if cfg.task != "grpo" and cfg.grpo != GRPOConfig():
        changed = [name for name, value in vars(cfg.grpo).items() if value != getattr(GRPOConfig(), name)]
        raise ConfigError(f"grpo.{changed[0]} is set, but task={cfg.task}: grpo.* keys configure task=grpo; add "
                          f"task=grpo or drop them")
    if cfg.task == "grpo":
        _check_grpo(cfg)


def _whole_sequences(cfg: JobConfig) -> None:
    for axis in ("pipeline", "context"):
        if getattr(cfg.ici_mesh, axis) * getattr(cfg.dcn_mesh, axis) != 1:
            raise ConfigError(f"task={cfg.task} scores whole sequences per rank; {axis} parallelism splits them: set "
                              f"ici_mesh.{axis}=1 and dcn_mesh.{axis}=1 (data, fsdp, tensor and expert work)")


def _check_dpo(cfg: JobConfig) -> None:
    if not (cfg.dpo.beta > 0 and math.isfinite(cfg.dpo.beta)):
        raise ConfigError(f"dpo.beta must be a positive number, got {cfg.dpo.beta}")
    if cfg.data.dataset in ("embedded", "synthetic") or cfg.data.mixture or cfg.data.streaming:
        raise ConfigError("task=dpo reads preference pairs from data.dataset (a jsonl of {prompt, chosen, rejected} "
                          "rows or a hub dataset), not the embedded corpus, synthetic data, a mixture or a stream")
    # data.messages_field / prompt_field (an SFT recipe's) are not read: pairs name theirs in dpo.*_field.
    _whole_sequences(cfg)


def advantage_scale(value: str) -> str:
    """grpo.scale_rewards as group_advantages' scale: true/group, batch, false/none."""
    scale = SCALES.get(str(value).lower())
    if scale is None:
        raise ConfigError(f"grpo.scale_rewards={value!r}: choose group (or true), batch, or none (or false)")
    return scale


def _check_grpo(cfg: JobConfig) -> None:
    grpo = cfg.grpo
    if cfg.data.dataset in ("embedded", "synthetic") or cfg.data.mixture or cfg.data.streaming:
        raise ConfigError("task=grpo reads prompts from data.dataset (a .jsonl/.json/.parquet of rows with a prompt "
                          "and the fields the rewards read, a hub dataset, or reasoning_gym:NAME), not the embedded "
                          "corpus, synthetic data, a mixture or a stream")
    if grpo.group_size < 2:
        raise ConfigError(f"grpo.group_size={grpo.group_size}: the advantages compare a prompt's completions with each "
                          "other, so a group needs at least 2")
    if cfg.global_batch_size % grpo.group_size:
        raise ConfigError(f"grpo.group_size={grpo.group_size} does not divide global_batch_size="
                          f"{cfg.global_batch_size} (the completions of a step, group_size per prompt); make "
                          "global_batch_size a multiple of it")
    if grpo.max_new_tokens < 1 or grpo.max_new_tokens >= cfg.seq_len:
        raise ConfigError(f"grpo.max_new_tokens={grpo.max_new_tokens} must be >= 1 and below seq_len={cfg.seq_len} "
                          "(a prompt takes the rest)")
    if not (grpo.temperature > 0 and math.isfinite(grpo.temperature)):
        raise ConfigError(f"grpo.temperature={grpo.temperature}: rollouts are sampled, so it must be > 0")
    if not 0 < grpo.top_p <= 1 or grpo.top_k < 0:
        raise ConfigError(f"grpo.top_p={grpo.top_p} must be in (0, 1] and grpo.top_k={grpo.top_k} >= 0 (0: off)")
    if grpo.compile_rollout and (cfg.ici_mesh.tensor * cfg.dcn_mesh.tensor > 1):
        raise ConfigError("grpo.compile_rollout=true compiles the decode step of one unsharded model; under tensor "
                          "parallelism drop it (the rollout runs eagerly)")
    if grpo.loss_type not in GRPO_LOSSES:
        raise not_one_of("grpo.loss_type", grpo.loss_type, GRPO_LOSSES)
    advantage_scale(grpo.scale_rewards)
    if not (0 <= grpo.clip_low < 1 and grpo.clip_high >= 0 and math.isfinite(grpo.clip_high)):
        raise ConfigError(f"grpo.clip_low={grpo.clip_low} must be in [0, 1) and grpo.clip_high={grpo.clip_high} >= 0")
    if not (grpo.beta >= 0 and math.isfinite(grpo.beta)):
        raise ConfigError(f"grpo.beta={grpo.beta} must be a finite number >= 0 (0: no KL term, no reference)")
    for key, value, ok in (("iterations", grpo.iterations, grpo.iterations >= 1),
                           ("gym_size", grpo.gym_size, grpo.gym_size >= 1),
                           ("reward_timeout_s", grpo.reward_timeout_s, grpo.reward_timeout_s > 0)):
        if not ok:
            raise ConfigError(f"grpo.{key}={value} must be {'> 0' if key == 'reward_timeout_s' else '>= 1'}")
    if any(not text for text in grpo.stop):
        raise ConfigError("grpo.stop holds an empty string, which would end every completion at once; drop it")
    if grpo.reward_errors not in ("fail", "zero"):
        raise not_one_of("grpo.reward_errors", grpo.reward_errors, ("fail", "zero"))
    _whole_sequences(cfg)
    from ember.finetune.grpo_rewards import build_rewards

    build_rewards(grpo.rewards, grpo.reward_weights, grpo.format_pattern, grpo.reward_errors)  # names, imports


def check_rollout_layout(cfg: JobConfig, dp: int) -> None:
    """task=grpo: each data-parallel rank samples whole groups, so group_size divides its share of the batch."""
    per_rank = cfg.global_batch_size // dp
    if cfg.task == "grpo" and cfg.grpo.compile_rollout and dp > 1:
        raise ConfigError(f"grpo.compile_rollout=true compiles the decode step of one unsharded model, not one over "
                          f"{dp} data-parallel ranks; drop it (the rollout runs eagerly)")
    if cfg.task == "grpo" and per_rank % cfg.grpo.group_size:
        raise ConfigError(f"grpo.group_size={cfg.grpo.group_size} does not divide each data-parallel rank's {per_rank} "
                          f"completions (global_batch_size={cfg.global_batch_size} over {dp} ranks): a group is "
                          "sampled on one rank; make global_batch_size a multiple of group_size x the ranks")
