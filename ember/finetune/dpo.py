"""Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290) in ember's one training loop.

`ember train ... task=dpo` trains on pairs `{"prompt" (or "messages"), "chosen", "rejected"}`: the loss of a
pair is -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))),
where log pi(y) sums the response tokens' log-probabilities (the prompt's are read, not scored) under the policy
being trained and ref is the frozen starting model. What differs from pretraining is only:
- data: each pair becomes two rows, chosen then rejected, padded to seq_len with the prompt and padding masked
  (PairSamples; the ordinary TokenLoader shuffles, shards and resumes them, so a micro-batch of B pairs is
  (2B, seq_len): B chosen rows then their B rejected rows);
- the loss (`DPOObjective`, called by step.ForwardBackward in place of the token cross-entropy);
- the reference: with LoRA, the same model with its adapters off (no second model in memory); otherwise a
  frozen copy of the starting weights, built and sharded like the policy. Either way the reference log-probs
  are computed on the fly, so any layout and any resume see the same reference.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.config_schema import DataConfig, DPOConfig
from ember.constants import IGNORE_INDEX
from ember.data.hub import import_datasets
from ember.data.jsonl import read_json_rows
from ember.data.loader import TrainLoader
from ember.data.tokenizer import AnyTokenizer
from ember.errors import DataError, UserFileNotFound
from ember.finetune.lora_state import buffer_names

if TYPE_CHECKING:
    from types import ModuleType

    import tokenizers

    from ember.data.chat import ChatTemplate
    from ember.parallel.mesh import ParallelMesh
    from ember.train.run import RunSpec

Logits = Union[torch.Tensor, list[torch.Tensor]]  # the model's output: whole, or in chunks along the sequence


# ---------------------------------------------------------------- the loss
def sequence_logprobs(logits: Logits, labels: torch.Tensor) -> torch.Tensor:
    """(B,) summed log-probability of each row's target tokens (labels != -100), in fp32. `logits` is (B, T, V)
    or the model's list of chunks of it along T (each chunk is reduced before the next is looked at)."""
    chunks = logits if isinstance(logits, (list, tuple)) else [logits]
    total = torch.zeros(labels.shape[0], device=labels.device)
    start = 0
    for chunk in chunks:
        part = labels[:, start:start + chunk.shape[1]]  # (B, T_i)
        start += chunk.shape[1]
        token_nll = F.cross_entropy(chunk.flatten(0, 1).float(), part.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="none")  # 0 where ignored
        total = total - token_nll.view(part.shape).sum(1)
    return total


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: (loss, chosen reward, rejected reward), the rewards being beta * (log pi - log ref) as the
    DPO paper's implicit reward (detached: they are reported, not trained)."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen_reward - rejected_reward)
    return loss, chosen_reward.detach(), rejected_reward.detach()


@dataclass
class DPOObjective:
    """The DPO loss of micro-batches laid out as PairSamples makes them, and the statistics the run logs.

    `reference(inputs, positions, document_ids)` returns the frozen reference model's logits (run under
    no_grad by this class)."""

    beta: float
    reference: Callable[..., Logits]
    # Since the last pop_metrics: pairs, summed reward margins, pairs where chosen won, summed rewards.
    _sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("pairs", "margin", "wins", "chosen",
                                                                            "rejected"), 0.0))

    def loss_sum(self, logits: Logits, inputs: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor],
                 document_ids: Optional[torch.Tensor],
                 autocast: Callable[[], Any] = contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss over this micro-batch's pairs, its statistics [pairs, margin, wins, chosen, rejected]);
        the reference forward runs in `autocast()`, the precision of the policy's."""
        pairs = inputs.shape[0] // 2
        policy = sequence_logprobs(logits, labels)  # (2B,)
        with torch.no_grad():
            with autocast():
                ref_logits = self.reference(inputs, positions, document_ids)
            ref = sequence_logprobs(ref_logits, labels)
        loss, chosen, rejected = dpo_loss(policy[:pairs], policy[pairs:], ref[:pairs], ref[pairs:], self.beta)
        margin = chosen - rejected
        stats = torch.stack([torch.tensor(float(pairs), device=margin.device), margin.sum(),
                             (margin > 0).float().sum(), chosen.sum(), rejected.sum()])
        return loss.sum(), stats

    def record(self, stats: torch.Tensor) -> None:
        """Add a training step's global statistics (summed over ranks) to the logging window."""
        for key, value in zip(self._sums, stats.tolist()):
            self._sums[key] += value

    def pop_metrics(self) -> dict[str, float]:
        """Means over the pairs trained since the last call: dpo/reward_margin, dpo/accuracy (chosen's reward
        above rejected's), dpo/chosen_reward, dpo/rejected_reward."""
        n = self._sums["pairs"]
        if not n:
            return {}
        out = {"dpo/reward_margin": self._sums["margin"] / n, "dpo/accuracy": self._sums["wins"] / n,
               "dpo/chosen_reward": self._sums["chosen"] / n, "dpo/rejected_reward": self._sums["rejected"] / n}
        self._sums = dict.fromkeys(self._sums, 0.0)
        return out


@contextlib.contextmanager
def as_base(policy: nn.Module, start: dict[str, torch.Tensor]) -> Any:
    """The LoRA policy run as the base it started from: adapters off, the persistent buffers training moves
    (DeepSeek-V3's router score biases) at their `start` values, and in eval mode, so that the MoE layers count
    no expert load from this forward (the score-bias update follows the policy's loads alone)."""
    from ember.finetune.lora import lora_disabled

    buffers = dict(policy.named_buffers())
    trained = {name: buffers[name].detach().clone() for name in start}
    was_training = policy.training
    with torch.no_grad():
        for name, value in start.items():
            buffers[name].copy_(value)
    policy.train(False)
    try:
        with lora_disabled(policy):
            yield
    finally:
        policy.train(was_training)
        with torch.no_grad():
            for name, value in trained.items():
                buffers[name].copy_(value)


def frozen_reference(spec: RunSpec, mesh: Optional[ParallelMesh], policy: nn.Module) -> Callable[..., Logits]:
    """The frozen starting model as a function of (inputs, positions, document_ids) -> its logits, in the policy's
    chunks: under LoRA the policy with its adapters off (no second model in memory); otherwise a second copy of
    the starting weights, built and sharded as the policy is (its init and model.init_from, never the resumed
    checkpoint). task=dpo's reference, and task=grpo's with grpo.beta > 0."""
    from ember.train.run import build_model

    if spec.cfg.lora.rank:
        start = {name: buffer.detach().clone() for name, buffer in policy.named_buffers()
                 if name in buffer_names([policy])}  # taken before any step or resume: the base's

        def reference(*inputs: Optional[torch.Tensor]) -> Logits:
            with as_base(policy, start):
                return policy(*inputs, chunks=spec.output_chunks)
        return reference
    frozen = build_model(spec, mesh).parts[0].requires_grad_(False).eval()

    def frozen_forward(*inputs: Optional[torch.Tensor]) -> Logits:
        return frozen(*inputs, chunks=spec.output_chunks)
    return frozen_forward


def dpo_objective(spec: RunSpec, mesh: Optional[ParallelMesh], policy: nn.Module) -> DPOObjective:
    """task=dpo's loss (spec: an ember.train.run.RunSpec), with the frozen starting model as its reference."""
    return DPOObjective(spec.cfg.dpo.beta, frozen_reference(spec, mesh, policy))


# ---------------------------------------------------------------- the data
@dataclass
class PairSamples:
    """Preference pairs as fixed-length rows for ember.data.loader.make_batch: sample i is pair i, and get()
    returns the chosen rows of the asked pairs followed by their rejected rows, (2n, seq_len + 1) each."""

    chosen: np.ndarray  # (pairs, seq_len + 1) token ids, padded
    rejected: np.ndarray
    chosen_mask: np.ndarray  # 1 where a token is a target (the response and its end)
    rejected_mask: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.chosen)

    @property
    def seq_len(self) -> int:
        return self.chosen.shape[1] - 1

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.concatenate([self.chosen[indices], self.rejected[indices]]).astype(np.int64)
        mask = np.concatenate([self.chosen_mask[indices], self.rejected_mask[indices]]).astype(np.bool_)
        return torch.from_numpy(rows), torch.from_numpy(mask)


def _read_pairs(spec: str, fields: tuple[str, ...], split_name: str) -> list[dict]:
    """Rows of a local jsonl/json file, or of a hub dataset (through `datasets`, where the network allows)."""
    path = Path(spec).expanduser()
    if path.is_file():
        located = read_json_rows(path, "DPO data")
    elif path.suffix in (".jsonl", ".json") or path.parent != Path("."):
        raise UserFileNotFound(f"DPO data '{spec}' does not exist; give a jsonl of {{prompt, chosen, rejected}} rows")
    else:
        datasets = import_datasets(f"DPO data from the hub ({spec})")
        located = [(f"{spec} row {i}", dict(r)) for i, r in enumerate(datasets.load_dataset(spec, split=split_name), 1)]
    for where, row in located:
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(f"{where} has no '{missing[0]}' field (DPO rows need {', '.join(fields)})")
    if not located:
        raise DataError(f"DPO data '{spec}' is empty")
    return [row for _, row in located]


def _fit(prompt: list[int], response: list[int], length: int) -> tuple[list[int], list[int]]:
    """Cut a pair's side to `length` tokens: the prompt from the left first (its end is what the response
    follows), then the response from the right."""
    if len(prompt) + len(response) > length:
        keep = max(length - len(response), 0)
        prompt = prompt[len(prompt) - keep:] if keep else []
        response = response[:length - len(prompt)]
    return prompt, response


def encode_pairs(rows: list[dict], tokenizer: AnyTokenizer, seq_len: int, prompt_field: str, chosen_field: str,
                 rejected_field: str, template: Optional[ChatTemplate] = None) -> PairSamples:
    """Token rows of every pair. A text prompt is followed by the response text (the split between them is
    lm-eval's: the response's tokens are what encode(prompt + response) adds after encode(prompt)), then EOS,
    which is a target. A `messages` prompt is rendered with the chat template and the response is the
    assistant's next turn, trained through its end-of-turn marker. Prompt tokens and padding are masked."""
    from ember.eval.scoring import encode_pair

    length = seq_len + 1
    out = {key: np.zeros((len(rows), length), np.int64) for key in ("chosen", "rejected")}
    masks = {key: np.zeros((len(rows), length), np.uint8) for key in ("chosen", "rejected")}
    encoder = None
    for i, row in enumerate(rows):
        for key, response_field in (("chosen", chosen_field), ("rejected", rejected_field)):
            response, prompt = row[response_field], row[prompt_field]
            if isinstance(response, list):  # a conversation ending with the assistant's turn: its text
                response = response[-1].get("content") if response and isinstance(response[-1], dict) else None
            if not isinstance(response, str) or not response.strip():
                raise DataError(f"DPO row {i + 1}: '{response_field}' must be non-empty text (or messages ending "
                                "with the assistant's)")
            if isinstance(prompt, str):
                prompt_ids, response_ids = encode_pair(tokenizer, prompt, response)
                response_ids = response_ids + [tokenizer.eos_id]
            elif isinstance(prompt, list):
                if template is None:
                    raise DataError(f"DPO row {i + 1}: '{prompt_field}' is a list of messages, which needs a chat "
                                    "template: set data.chat_template (or data.tokenizer to a folder that has one)")
                from ember.data import chat

                encoder = encoder or chat.chat_encoder(tokenizer)
                prompt_ids, response_ids = _encode_chat_pair(chat, template, encoder, prompt, response, i)
            else:
                raise DataError(f"DPO row {i + 1}: '{prompt_field}' must be text or a list of messages")
            prompt_ids, response_ids = _fit(prompt_ids, response_ids, length)
            ids = prompt_ids + response_ids
            out[key][i, :len(ids)] = ids
            out[key][i, len(ids):] = tokenizer.eos_id  # padding: read by nothing that is scored
            masks[key][i, len(prompt_ids):len(ids)] = 1
    return PairSamples(out["chosen"], out["rejected"], masks["chosen"], masks["rejected"])


def _encode_chat_pair(chat: ModuleType, template: ChatTemplate, encoder: tokenizers.Tokenizer, prompt: list,
                      response: str, row: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a conversation prompt and the assistant's reply: the ids of the whole
    rendering, split where the reply's span starts (chat.assistant_spans finds it, refusing templates that
    cannot mark it); the tokens after the span's end (a trailing newline) are dropped."""
    messages = chat.check_messages(list(prompt) + [{"role": "assistant", "content": response}],
                                   f"DPO row {row + 1}")
    text = chat.render(template, messages)
    start, end = chat.assistant_spans(template, messages, text)[-1]
    encoding = encoder.encode(text, add_special_tokens=False)
    ids, offsets = encoding.ids, encoding.offsets
    first = next(t for t, (_, token_end) in enumerate(offsets) if token_end > start)
    last = max((t for t, (token_start, _) in enumerate(offsets) if token_start < end), default=first)
    return list(ids[:first]), list(ids[first:last + 1])


def build_pair_loader(data_cfg: DataConfig, tokenizer: AnyTokenizer, *, dpo_cfg: DPOConfig, split: str, seq_len: int,
                      micro_batch_size: int, dp_rank: int, dp_world: int, seed: int,
                      vocab_size: Optional[int] = None) -> TrainLoader:
    """The TokenLoader of one split of the pairs in data.dataset: the last data.val_fraction of the pairs (at
    least one) are held out for validation, the rest train. (vocab_size: build_loader's interface; the trainer
    has checked that the tokenizer fits the model.)"""
    from ember.data.loader import TokenLoader

    rows = _read_pairs(data_cfg.dataset, (dpo_cfg.prompt_field, dpo_cfg.chosen_field, dpo_cfg.rejected_field),
                       data_cfg.split)
    n_val = max(1, int(len(rows) * data_cfg.val_fraction)) if len(rows) > 1 else 0
    part = rows[len(rows) - n_val:] if split == "val" else rows[:len(rows) - n_val]
    if len(part) < micro_batch_size * dp_world:
        raise DataError(f"DPO data '{data_cfg.dataset}' has {len(part)} {split} pairs, fewer than one batch of "
                        f"{micro_batch_size} x {dp_world} ranks; add pairs or lower micro_batch_size")
    template = None
    if any(isinstance(row[dpo_cfg.prompt_field], list) for row in part):
        from ember.data import chat

        template = chat.load_template(getattr(data_cfg, "chat_template", None), tokenizer)
    samples = encode_pairs(part, tokenizer, seq_len, dpo_cfg.prompt_field, dpo_cfg.chosen_field,
                           dpo_cfg.rejected_field, template)
    return TokenLoader(samples, name=f"{data_cfg.dataset} (pairs)", split=split, micro_batch_size=micro_batch_size,
                       dp_rank=dp_rank, dp_world=dp_world, seed=seed, num_workers=data_cfg.num_workers,
                       prefetch=data_cfg.prefetch,
                       num_tokens=int(samples.chosen_mask.sum() + samples.rejected_mask.sum()))
