"""task=grpo: reinforcement learning from verifiable rewards (GRPO and its variants) in ember's one training loop.

A step, on every rank of the torch engine (ember/train/torch_engine.py calls `GRPOStep.run` in place of the token
loss's forward/backward; clipping and the optimizer step are the engine's as for every task):
1. Rollouts: this rank's prompts (PromptLoader: global_batch_size / group_size prompts per step over the
   data-parallel ranks) each get group_size completions sampled by ember's KV-cache generation from the policy
   itself, sharded as it trains (FSDP, TP, HSDP; LoRA adapters on), with no copy of the weights and no sync. The
   sampler is seeded by (seed, rollout batch, data-parallel rank), so a resume samples what the straight run did.
2. Rewards (ember/finetune/grpo_rewards.py) of every completion, gathered over the ranks; the advantages
   (ember/finetune/grpo_loss.py) are computed from the whole rollout batch's rewards alike on every rank.
3. With grpo.iterations > 1, the rollout-time log-probabilities (the old policy); with grpo.beta > 0, the frozen
   reference's (ember/finetune/dpo.py's frozen_reference: the base with adapters off under LoRA).
4. The update: the rank's rows in micro-batches of micro_batch_size, the clipped-ratio loss of each with the whole
   batch's normalizers, so that the micro-batches' and ranks' gradients sum to the global batch's.
A rollout batch trains grpo.iterations steps; its rows (tokens, advantages, old and reference log-probs) are part
of the loader's state, so a resume between them continues on the same rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from ember.config_schema import DataConfig, JobConfig
from ember.data.tokenizer import AnyTokenizer
from ember.errors import ConfigError, DataError
from ember.finetune import grpo_loss, grpo_rewards
from ember.finetune.checks import advantage_scale
from ember.finetune.grpo_data import PromptLoader, PromptRow, load_prompts, prompt_of
from ember.finetune.grpo_rollout import sample, training_rows
from ember.metrics.profiling import phase

if TYPE_CHECKING:
    from ember.parallel.mesh import ParallelMesh
    from ember.train.run import RunSpec
    from ember.train.step import ForwardBackward

ROW_KEYS = ("inputs", "targets", "mask", "advantages", "old_logprobs", "ref_logprobs")


# ---------------------------------------------------------------- the data: prompts, dealt per step
@dataclass
class RolloutBatch:
    """One rank's prompts of one rollout batch and, once sampled and scored, the rows the steps train on."""

    index: int  # the rollout batch's number in the run (the sampler's seed derives from it)
    prompts: list[PromptRow]
    rows: Optional[dict[str, torch.Tensor]] = None  # ROW_KEYS (those that apply), this rank's


@dataclass
class Slot:
    """One micro-batch of a step: the `micro`-th micro_batch_size rows of `batch` (what the trainer's loop hands
    the engine in place of (inputs, labels))."""

    batch: RolloutBatch
    micro: int
    loader: GRPOLoader


class GRPOLoader:
    """task=grpo's TrainLoader: per step, grad_accum slots of one rollout batch, which stays for grpo.iterations
    steps; its state is the prompts' position, the step within the batch and the batch's rows."""

    def __init__(self, prompts: PromptLoader, grad_accum: int, iterations: int, name: str):
        self.prompts, self.grad_accum, self.iterations, self.name = prompts, grad_accum, iterations, name
        self.dp_world = prompts.world
        self.batch: Optional[RolloutBatch] = None
        self.batches, self.iteration = 0, 0  # rollout batches drawn; steps taken on the current one
        self.trained_tokens = 0  # tokens of every row the steps trained on, over every rank

    def __iter__(self) -> Iterator[Slot]:
        while True:
            if self.batch is None or self.iteration >= self.iterations:
                self.batch = RolloutBatch(self.batches, self.prompts.next_batch())
                self.batches, self.iteration = self.batches + 1, 0
            self.iteration += 1
            for micro in range(self.grad_accum):
                yield Slot(self.batch, micro, self)

    def state_dict(self) -> dict[str, Any]:
        keep = self.batch is not None and self.iteration < self.iterations and self.batch.rows is not None
        return {"prompts": self.prompts.state_dict(), "batches": self.batches, "iteration": self.iteration,
                "trained_tokens": self.trained_tokens, "rows": dict(self.batch.rows) if keep else None,
                "dp_world": self.dp_world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.batches, self.iteration = int(state["batches"]), int(state["iteration"])
        self.trained_tokens = int(state["trained_tokens"])
        rows = state.get("rows")
        if rows is not None and int(state["dp_world"]) != self.dp_world:  # the rows are each rank's own
            raise ConfigError(f"this checkpoint is between two of grpo.iterations={self.iterations} steps on one "
                              f"rollout batch, whose rows were sampled over {state['dp_world']} data-parallel ranks, "
                              f"not {self.dp_world}: resume it with {state['dp_world']}, or from a checkpoint at a "
                              "step that starts a rollout batch (a multiple of grpo.iterations)")
        self.batch = RolloutBatch(self.batches - 1, [], dict(rows)) if rows is not None else None
        if rows is None:
            self.iteration = self.iterations  # the next step draws the next rollout batch

    def reset(self) -> None:
        """No validation split (build_prompt_loader refuses one)."""

    def close(self) -> None:
        """Nothing runs ahead: rollouts are sampled in the step."""

    def describe(self) -> str:
        return self.name

    def mixture_counts(self) -> Optional[dict[str, int]]:
        return None


def build_prompt_loader(data_cfg: DataConfig, tokenizer: AnyTokenizer, *, cfg: JobConfig, split: str, seq_len: int,
                        micro_batch_size: int, dp_rank: int, dp_world: int, seed: int,
                        vocab_size: Optional[int] = None) -> GRPOLoader:
    """The prompts of data.dataset dealt over the data-parallel ranks (build_loader's interface; vocab_size: the
    trainer has checked that the tokenizer fits the model). task=grpo has no validation loss: its held-out measure
    is a generative eval (`ember eval RUN gen=FILE`), so split="val" is refused in one line the trainer prints."""
    if split != "train":
        raise DataError("task=grpo trains on rollouts and reports rewards, not a validation loss; measure held-out "
                        "accuracy with `ember eval RUN gen=FILE`")
    grpo = cfg.grpo
    needs = sorted({name for reward in grpo.rewards for name in grpo_rewards.NEEDS.get(reward, ())})
    rows = load_prompts(data_cfg.dataset, prompt_encoder(data_cfg, tokenizer, grpo.prompt_field), needs,
                        seq_len - grpo.max_new_tokens, grpo.gym_size, seed, grpo.prompt_field, data_cfg.split)
    completions_per_rank = cfg.global_batch_size // dp_world
    prompts = PromptLoader(rows, completions_per_rank // grpo.group_size, dp_rank, dp_world, seed)
    return GRPOLoader(prompts, completions_per_rank // micro_batch_size, grpo.iterations,
                      f"{data_cfg.dataset} ({len(rows):,} prompts, {grpo.group_size} completions each per step)")


def prompt_encoder(data_cfg: DataConfig, tokenizer: AnyTokenizer, prompt_field: str) -> Callable[[dict], list[int]]:
    """row -> prompt token ids: text as the tokenizer encodes it (as SFT's prompts are), messages rendered with the
    chat template (data.chat_template) and its generation prompt, so the completion is the assistant's turn."""
    state: dict[str, Any] = {}

    def encode(row: dict) -> list[int]:
        prompt = prompt_of(row, prompt_field)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        from ember.data import chat

        if "template" not in state:
            state["template"] = chat.load_template(data_cfg.chat_template, tokenizer)
            state["encoder"] = chat.chat_encoder(tokenizer)
        if not all(isinstance(m, dict) and m.get("role") in chat.ROLES and isinstance(m.get("content"), str)
                   for m in prompt):
            raise DataError(f'the messages must be {{"role": one of {", ".join(chat.ROLES)}, "content": "text"}} '
                            "objects; fix the row")
        text = chat.render(state["template"], prompt, add_generation_prompt=True)
        return list(state["encoder"].encode(text, add_special_tokens=False).ids)
    return encode


# ---------------------------------------------------------------- the step
@dataclass
class _Window:
    """Sums since the last logging step, for the metrics record."""

    steps: int = 0
    completions: int = 0
    reward_sum: Optional[torch.Tensor] = None  # (k,) per reward function
    total_sum: float = 0.0  # weighted reward
    group_std_sum: float = 0.0  # of the total reward, per group
    groups: int = 0
    zero_std_groups: int = 0
    binary: Optional[torch.Tensor] = None  # (k,) every reward so far was 0 or 1
    length_sum: int = 0
    length_max: int = 0
    truncated: int = 0
    tokens: float = 0.0  # completion tokens the loss counted
    stats: dict[str, float] = field(default_factory=dict)  # token-weighted: clipped_low/high, kl, entropy
    rollout_s: float = 0.0
    update_s: float = 0.0
    generated: int = 0  # tokens sampled (this rank's share summed over ranks)
    trained: int = 0  # tokens of the rows trained on (prompt and completion), over every rank
    forward_tokens: int = 0  # tokens of the forwards without backward (rollout, old and reference), every rank


class GRPOStep:
    """Rollouts, rewards and the GRPO update of one step, on the engine's model and ForwardBackward (its mesh,
    autocast and reductions)."""

    def __init__(self, spec: RunSpec, mesh: Optional[ParallelMesh], model: nn.Module, tokenizer: AnyTokenizer,
                 forward_backward: ForwardBackward):
        from ember.finetune.dpo import frozen_reference

        cfg = spec.cfg
        self.spec, self.cfg, self.grpo = spec, cfg, cfg.grpo
        self.mesh, self.model, self.tokenizer, self.fb = mesh, model, tokenizer, forward_backward
        self.rewards = grpo_rewards.build_rewards(self.grpo.rewards, self.grpo.reward_weights,
                                                  self.grpo.format_pattern, self.grpo.reward_errors)
        self.rewards.timeout_s = self.grpo.reward_timeout_s
        self.scale = advantage_scale(self.grpo.scale_rewards)
        self.reference = frozen_reference(spec, mesh, model) if self.grpo.beta > 0 else None
        self.dp_rank = mesh.dp_rank if mesh is not None else 0
        self.replica = spec.shape.degree("tensor")  # ranks holding one replica's rows (pipeline, context refused)
        self.window = _Window()
        self.trained_tokens = 0

    # ------------------------------------------------------------ helpers
    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """(dp x n, ...) every data-parallel rank's (n, ...) rows in rank order (an all-reduce of zero-filled
        slots: the tensor ranks of a replica hold the same rows and divide out)."""
        n, dp = local.shape[0], self.spec.shape.dp
        whole = torch.zeros((dp * n, *local.shape[1:]), dtype=torch.float64, device=self.fb.device)
        whole[self.dp_rank * n:(self.dp_rank + 1) * n] = local.to(whole)
        return (self.fb.all_sum(whole) / self.replica).to(local.dtype)

    def _sum(self, value: float) -> float:
        """A number summed over every data-parallel rank."""
        return float(self.fb.all_sum(torch.tensor(float(value), dtype=torch.float64, device=self.fb.device))
                     / self.replica)

    def _logprobs(self, inputs: torch.Tensor, targets: torch.Tensor, model: Callable[..., Any],
                  entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, T) log-probabilities of `targets` under `model`'s tempered logits (the policy rollouts sample from),
        and with `entropy` the (B, T) entropies of those distributions (no gradient)."""
        with self.fb.autocast():
            logits = model(inputs, None, None)
        chunks = logits if isinstance(logits, (list, tuple)) else [logits]
        logprobs, entropies, start = [], [], 0
        for chunk in chunks:
            part = targets[:, start:start + chunk.shape[1]]
            start += chunk.shape[1]
            scaled = chunk.float() if self.grpo.temperature == 1 else chunk.float() / self.grpo.temperature
            log_p = torch.log_softmax(scaled, dim=-1)  # (one pass serves the log-probs and the entropy)
            logprobs.append(log_p.gather(-1, part.unsqueeze(-1)).squeeze(-1))
            if entropy:
                with torch.no_grad():
                    entropies.append(-(log_p.exp() * log_p).sum(-1))
        return torch.cat(logprobs, 1), (torch.cat(entropies, 1) if entropy else None)

    def _policy(self, *inputs: Optional[torch.Tensor]) -> Any:
        return self.model(*inputs, chunks=self.spec.output_chunks)

    # ------------------------------------------------------------ rollouts
    @torch.no_grad()
    def rollout(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Sample, score and prepare this rank's rows of `batch` (see the module docstring)."""
        grpo, started = self.grpo, time.perf_counter()
        seed = (self.cfg.seed * 1_000_003 + batch.index) * 4099 + self.dp_rank
        with phase("rollout"), self.fb.autocast():
            rollouts = sample(self.model, self.tokenizer, [p.prompt_ids for p in batch.prompts], grpo.group_size,
                              max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature,
                              top_k=grpo.top_k or None, top_p=grpo.top_p if grpo.top_p < 1 else None,
                              stop=list(grpo.stop), seed=seed, sharded=self.mesh is not None,
                              cache_dtype=self.spec.autocast_dtype, compile=grpo.compile_rollout,
                              cache_len=self.cfg.seq_len if grpo.compile_rollout else None)
        self.model.train()
        rows = [p for p in batch.prompts for _ in range(grpo.group_size)]
        prompt_texts = [self.tokenizer.decode(p.prompt_ids) for p in rows]
        with phase("rewards"):
            _, per = self.rewards.score(prompt_texts, rollouts.texts, [p.row for p in rows],
                                        [p.where for p in rows])
        every = self._gather(per.double())  # (N, k): the whole rollout batch's rewards
        weights = torch.tensor(self.rewards.weights, dtype=torch.float64, device=every.device)
        totals = every @ weights
        advantages = grpo_loss.group_advantages(totals, grpo.group_size, self.scale)
        n = len(rows)
        local_advantages = advantages[self.dp_rank * n:(self.dp_rank + 1) * n].float().cpu()
        pad = self.tokenizer.eos_id if getattr(self.tokenizer, "eos_id", None) is not None else 0
        inputs, targets, mask = training_rows(rollouts, grpo.mask_truncated, pad)
        out = {"inputs": inputs, "targets": targets, "mask": mask, "advantages": local_advantages}
        no_grad_models = [("ref_logprobs", self.reference)] if self.reference is not None else []
        if grpo.iterations > 1:  # the policy that sampled, as the ratio's denominator for every iteration
            no_grad_models.append(("old_logprobs", self._policy))
        self.model.eval()  # (MoE layers count no expert load and attach no router loss in these forwards)
        for key, model in no_grad_models:
            parts = []
            for micro in range(0, n, self.cfg.micro_batch_size):
                part_inputs = inputs[micro:micro + self.cfg.micro_batch_size].to(self.fb.device)
                part_targets = targets[micro:micro + self.cfg.micro_batch_size].to(self.fb.device)
                parts.append(self._logprobs(part_inputs, part_targets, model)[0].cpu())
            out[key] = torch.cat(parts)
        self.model.train()
        # forwards without backward: the rollout's (prompt and completion) and each no-grad log-prob pass
        self._record_rollout(every, totals, rollouts, time.perf_counter() - started,
                             (1 + len(no_grad_models)) * int(inputs.ne(pad).sum()))
        return out

    def _record_rollout(self, every: torch.Tensor, totals: torch.Tensor, rollouts: Any, seconds: float,
                        forward_tokens: int) -> None:
        w, group = self.window, self.grpo.group_size
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float64)
        counts = torch.tensor([lengths.sum().item(), float(sum(rollouts.truncated)), float(forward_tokens)],
                              dtype=torch.float64, device=self.fb.device)
        counts = self.fb.all_sum(counts) / self.replica
        w.completions += every.shape[0]
        w.reward_sum = every.sum(0).cpu() + (w.reward_sum if w.reward_sum is not None else 0)
        binary = ((every == 0) | (every == 1)).all(0).cpu()
        w.binary = binary if w.binary is None else w.binary & binary
        w.total_sum += float(totals.sum())
        stds = totals.view(-1, group).std(dim=1)
        w.group_std_sum += float(stds.sum())
        w.groups += stds.numel()
        w.zero_std_groups += int((stds < grpo_loss.STD_EPS).sum())
        w.length_sum += int(counts[0])
        w.length_max = max(w.length_max, int(self._max(lengths.max())))
        w.truncated += int(counts[1])
        w.generated += int(counts[0])
        w.forward_tokens += int(counts[2])
        w.rollout_s += seconds

    def _max(self, value: torch.Tensor) -> float:
        import torch.distributed as dist

        value = value.to(self.fb.device, torch.float64).reshape(1)
        if self.mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    # ------------------------------------------------------------ the update
    def run(self, slots: list[Slot]) -> float:
        """One step: rollouts when the batch has none yet, then forward/backward over this rank's micro-batches
        (gradients accumulate in the parameters; the engine clips and steps). Returns the global batch's loss."""
        grpo, batch = self.grpo, slots[0].batch
        if batch.rows is None:
            batch.rows = self.rollout(batch)
        started = time.perf_counter()
        rows, size = batch.rows, self.cfg.micro_batch_size
        pad = self.tokenizer.eos_id if getattr(self.tokenizer, "eos_id", None) is not None else 0
        # the whole rollout batch's completion tokens and its rows' tokens, in one reduction
        local = torch.stack([rows["mask"].sum(), rows["inputs"].ne(pad).sum()]).double()[None]
        counted, trained = self._gather(local).sum(0).tolist()
        token_count = torch.tensor(counted, device=self.fb.device)
        loss_total = torch.zeros((), device=self.fb.device)
        stats_sum: dict[str, torch.Tensor] = {}
        for slot in slots:
            part = {key: rows[key][slot.micro * size:(slot.micro + 1) * size].to(self.fb.device)
                    for key in ROW_KEYS if key in rows}
            with phase("forward"):
                logprobs, entropy = self._logprobs(part["inputs"], part["targets"], self._policy, entropy=True)
            old = part.get("old_logprobs", logprobs.detach())
            loss, stats = grpo_loss.policy_loss(
                logprobs, old, part["advantages"], part["mask"], loss_type=grpo.loss_type, clip_low=grpo.clip_low,
                clip_high=grpo.clip_high, beta=grpo.beta, ref_logprobs=part.get("ref_logprobs"),
                max_completion_length=grpo.max_new_tokens, token_count=token_count,
                rows_total=self.cfg.global_batch_size)
            with phase("backward"):
                loss.backward()
            loss_total += loss.detach()
            tokens = part["mask"].sum()
            stats["entropy"] = (entropy * part["mask"]).sum() / tokens.clamp(min=1)
            for key, value in stats.items():  # token-weighted, to divide by the window's tokens
                stats_sum[key] = stats_sum.get(key, 0) + value.detach().double() * tokens
        for key, value in stats_sum.items():
            self.window.stats[key] = self.window.stats.get(key, 0.0) + self._sum(value)
        self.window.tokens += counted
        self.window.steps += 1
        self.window.trained += int(trained)
        self.window.update_s += time.perf_counter() - started
        slots[0].loader.trained_tokens += int(trained)
        self.trained_tokens = slots[0].loader.trained_tokens
        return float(self.fb.all_sum(loss_total) / self.replica)

    # ------------------------------------------------------------ metrics
    def pop_metrics(self, record: dict[str, Any]) -> dict[str, Any]:
        """grpo/* over the logging window, and `record`'s throughput (ember/metrics/run_metrics.py's, which counts
        global_batch_size x seq_len tokens a step) in the tokens GRPO really processed: the rows trained (prompt and
        completion) for tokens_per_s, and for TFLOP/s and MFU also the forwards without backward (the rollout's,
        the old and reference log-probs': 2 N per token, a third of training's 6 N)."""
        w, names = self.window, self.rewards.names
        if not w.steps:
            return {}
        window_time, world_size = record["step_time_s"] * w.steps, self.spec.world_size
        peak = record.get("mfu_peak_tflops")
        tokens = max(w.tokens, 1.0)
        out: dict[str, Any] = {f"grpo/{key}": value / tokens for key, value in w.stats.items()}
        out.update({"grpo/update_s": w.update_s,
                    "grpo/update_tokens_per_s": w.trained / w.update_s if w.update_s else None})
        if w.completions:  # the window sampled rollouts (with grpo.iterations > 1, not every step does)
            out["grpo/reward"] = w.total_sum / w.completions
            for name, value, binary in zip(names, (w.reward_sum / w.completions).tolist(), w.binary.tolist()):
                out[f"grpo/reward/{name}"] = value
                if binary:  # a 0/1 reward's mean is an accuracy
                    out[f"grpo/accuracy/{name}"] = value
            out.update({
                "grpo/reward_std": w.group_std_sum / max(w.groups, 1),
                "grpo/zero_std_groups": w.zero_std_groups / max(w.groups, 1),
                "grpo/completion_length": w.length_sum / w.completions,
                "grpo/completion_length_max": w.length_max, "grpo/truncated": w.truncated / w.completions,
                "grpo/rollout_s": w.rollout_s,
                "grpo/rollout_tokens_per_s": w.generated / w.rollout_s if w.rollout_s else None,
            })
        for k, name in enumerate(names):
            if self.rewards.errors[k]:
                out[f"grpo/reward_errors/{name}"] = self.rewards.errors[k]  # since this process started
        flops = self.spec.flops_per_token * (w.trained + w.forward_tokens / 3)
        per_device = flops / window_time / world_size
        out.update({"tokens_per_s": w.trained / window_time, "tokens_per_s_per_device": w.trained / window_time
                    / world_size, "tflops_per_device": per_device / 1e12, "tokens_seen": self.trained_tokens,
                    "mfu": per_device / (peak * 1e12) if peak else None})
        self.window = _Window()
        return out
