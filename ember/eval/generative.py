"""`ember eval RUN gen=FILE`: held-out accuracy of greedy completions, scored by GRPO's reward functions.

Each row of FILE (.jsonl, .json or .parquet; or `reasoning_gym:NAME`, rows drawn from that generator) holds a
prompt (`prompt`, or the column gen.prompt_field names: text, or chat messages rendered with the run's
data.chat_template and its generation prompt) and what the rewards read (`answer` for exact and math). Every
prompt is continued greedily by ember's KV-cache generation (ember/generate.py) in batches of eval.batch_size,
up to gen.max_new_tokens tokens or a gen.stop string, and each completion is scored by the rewards
(ember/finetune/grpo_rewards.py: exact, math, format, module:function). A reward's metric is its mean over the
rows: for a 0/1 reward such as exact or math, the accuracy.

The gen.* keys mirror task=grpo's grpo.* keys of the same names, and a GRPO run's own max_new_tokens, stop,
prompt_field and format_pattern are the defaults, so the eval asks what training asked. On a mesh the batches
are shared over the data-parallel ranks as the other tasks share theirs (ember/eval/distributed.py); each rank
decodes until every rank is done, since every forward of a sharded model is a collective.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from ember.config_schema import DataConfig
from ember.data.jsonl import read_json_rows
from ember.errors import ConfigError, DataError, EmberError, UserFileNotFound
from ember.eval.distributed import EvalRanks
from ember.finetune.grpo import prompt_encoder
from ember.finetune.grpo_data import GYM_PREFIX, prompt_of, read_prompt_rows
from ember.finetune.grpo_rewards import NEEDS, Rewards, build_rewards
from ember.finetune.grpo_rollout import every_rank_done
from ember.generate import generate
from ember.storage.location import as_path, check_output

if TYPE_CHECKING:
    from ember.data.tokenizer import AnyTokenizer

# Held-out rows of a reasoning-gym generator: it draws row i from the seed seed + i, so a training run's
# grpo.gym_size rows from its seed S are rows S .. S + gym_size - 1, and these start far past any such range.
GYM_SEED = 1_000_000
RUN_DEFAULTS = ("max_new_tokens", "stop", "prompt_field", "format_pattern")  # a GRPO run's, taken as gen's


@dataclass
class GenOptions:
    """`ember eval`'s gen.* keys (typed by the config's override path, as eval.* and data.* are)."""

    rewards: list[str] = field(default_factory=lambda: ["exact"])  # exact | math | format | module:function
    reward_weights: list[float] = field(default_factory=list)  # one per reward (empty: 1 each), for `reward`
    format_pattern: str = ""  # the format reward's regex, which the whole completion must match
    reward_errors: str = "fail"  # a reward that raises or times out: fail (one line) | zero (scored 0, counted)
    reward_timeout_s: float = 5.0  # per call of a reward on one completion
    max_new_tokens: int = 256  # a completion's length limit
    stop: list[str] = field(default_factory=list)  # strings that end a completion (besides EOS), cut from it
    prompt_field: str = "prompt"  # a row's prompt: text, or a list of messages (else its `messages`)
    gym_size: int = 200  # rows drawn from a reasoning_gym:NAME generator
    seed: int = GYM_SEED  # the generator's first row (see GYM_SEED)
    completions: Optional[str] = None  # a .jsonl written with every prompt, completion and reward


GEN_KEYS = tuple(f"gen.{name}" for name in GenOptions.__dataclass_fields__)
LIST_KEYS = ("gen.rewards", "gen.reward_weights", "gen.stop")  # `gen.rewards=math` means [math]


@dataclass
class GenPrompt:
    where: str  # FILE line N, FILE row N or reasoning_gym:NAME:I, for errors
    row: dict[str, Any]  # what the rewards read
    ids: list[int]  # the prompt's tokens (chat messages rendered)


@dataclass
class GenResult:
    metrics: dict[str, Any]  # eval.json's entry for gen, without its data
    records: list[dict[str, Any]]  # per row, what gen.completions writes


def in_gen_terms(err: EmberError) -> EmberError:
    """GRPO's prompt reader and rewards word their errors in task=grpo's keys; the same mistakes here are gen's."""
    text = str(err).replace("grpo.", "gen.").replace("data.dataset=", "gen=")
    return type(err)(text)


def run_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The gen.* defaults a run's config.yaml implies: a GRPO run's own generation and prompt keys."""
    if config.get("task") != "grpo":
        return {}
    grpo = config.get("grpo") or {}
    return {key: grpo[key] for key in RUN_DEFAULTS if key in grpo}


def check_options(options: GenOptions, spec: str, config: dict[str, Any]) -> None:
    """gen's keys checked before any work: the rewards built (names, weights, a module:function imported, math's
    package there), the numbers, the stop strings, and a generator's rows apart from what the run trained on."""
    try:
        build_rewards(options.rewards, options.reward_weights, options.format_pattern, options.reward_errors)
    except EmberError as err:
        raise in_gen_terms(err) from None
    if "math" in options.rewards and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("the math reward needs math-verify: pip install -e '.[rl]'")
    for name in ("max_new_tokens", "gym_size", "reward_timeout_s"):
        if not getattr(options, name) > 0:  # nan too
            raise ConfigError(f"gen.{name} must be > 0, got {getattr(options, name)}")
    if any(s == "" for s in options.stop):
        raise ConfigError("gen.stop holds an empty string, which would end every completion before its first "
                          "token; give the text to stop at")
    check_output(options.completions, "gen.completions")  # a URL: its store reachable
    if options.completions is not None and Path(options.completions).expanduser().is_dir():
        raise ConfigError(f"gen.completions={options.completions} is a directory; name a .jsonl file to write")
    data = config.get("data") or {}
    if spec.startswith(GYM_PREFIX) and config.get("task") == "grpo" and data.get("dataset") == spec:
        first, count = int(config.get("seed", 0)), int((config.get("grpo") or {}).get("gym_size", 1000))
        if options.seed < first + count and first < options.seed + options.gym_size:
            last = options.seed + options.gym_size - 1
            raise ConfigError(f"gen.seed={options.seed} draws rows {options.seed}..{last} of {spec}, and the run "
                              f"trained on its rows {first}..{first + count - 1} (seed {first}, grpo.gym_size={count});"
                              f" a held-out eval needs gen.seed >= {first + count}")


def read_rows(spec: str, options: GenOptions, limit: Optional[int] = None) -> list[tuple[str, dict]]:
    """(where, row) of the first `limit` rows of `spec` (every row checked: a prompt, and the fields the rewards
    read), before the model loads."""
    if spec.startswith(GYM_PREFIX):
        try:
            located = read_prompt_rows(spec, gym_size=options.gym_size, seed=options.seed)
        except EmberError as err:
            raise in_gen_terms(err) from None
    else:
        if "://" in spec:  # a file on a store: its local copy (ember/storage/cache.py)
            from ember.storage.cache import local_copy
            from ember.storage.location import check_source_url

            check_source_url(spec, "gen data")
            spec = str(local_copy(spec, "gen data"))
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserFileNotFound(f"gen data '{spec}' does not exist; give a .jsonl, .json or .parquet file of "
                                   f"prompts, or {GYM_PREFIX}NAME")
        if not path.is_file() or path.suffix not in (".jsonl", ".json", ".parquet"):
            raise DataError(f"gen data '{spec}' is not a .jsonl, .json or .parquet file of prompts")
        located = read_prompt_rows(spec) if path.suffix == ".parquet" else read_json_rows(path, "gen data")
    if not located:
        raise DataError(f"gen data '{spec}' holds no rows")
    needs = {name: reward for reward in options.rewards for name in NEEDS.get(reward, ())}
    for where, row in located:
        if prompt_of(row, options.prompt_field) is None:
            raise DataError(f"{where}: no '{options.prompt_field}' (text or messages) or 'messages' to start a "
                            "completion from; set gen.prompt_field to the row's prompt column")
        missing = [name for name in needs if row.get(name) is None]  # (a columnar file's absent value is null)
        if missing:
            raise DataError(f"{where}: no '{missing[0]}', which the {needs[missing[0]]} reward reads")
    return located if limit is None else located[:limit]


def encode_prompts(rows: list[tuple[str, dict]], tokenizer: AnyTokenizer, data_cfg: DataConfig,
                   options: GenOptions, max_seq_len: int) -> list[GenPrompt]:
    """Each row's prompt as tokens, checked to leave room for gen.max_new_tokens in the model: after the model
    and tokenizer load, before any generation."""
    encode = prompt_encoder(data_cfg, tokenizer, options.prompt_field)
    prompts = []
    for where, row in rows:
        try:
            ids = encode(row)
        except DataError as err:  # a chat prompt the template cannot render
            raise DataError(f"{where}: {err}") from None
        if not ids:
            raise DataError(f"{where}: the prompt encodes to no tokens; give it some text")
        if len(ids) + options.max_new_tokens > max_seq_len:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens, and with gen.max_new_tokens="
                            f"{options.max_new_tokens} that passes the model's max_seq_len={max_seq_len}; lower "
                            "gen.max_new_tokens or shorten the prompt")
        prompts.append(GenPrompt(where, row, ids))
    return prompts


def evaluate(model: nn.Module, tokenizer: AnyTokenizer, prompts: list[GenPrompt], options: GenOptions,
             batch_size: int = 16, ranks: EvalRanks = EvalRanks()) -> GenResult:
    """Greedy completions of every prompt, scored. Batches hold prompts of similar lengths (less padding); on a
    mesh they are shared over the data-parallel ranks and the completions gathered, then every rank scores them
    all (the same numbers, and a reward's error raised on every rank alike)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    done = every_rank_done if ranks.distributed else None
    generated: dict[int, tuple[str, int, str]] = {}
    for batch in ranks.share(batches):
        if batch is None:  # no rows left here: one token of EOS decoded until every rank is done
            generate(model, tokenizer, [[tokenizer.eos_id]], max_new_tokens=options.max_new_tokens,
                     temperature=0.0, all_done=lambda _: every_rank_done(True))
            continue
        out = generate(model, tokenizer, [prompts[i].ids for i in batch], max_new_tokens=options.max_new_tokens,
                       temperature=0.0, stop=list(options.stop), all_done=done)
        for i, generation in zip(batch, out):
            generated[i] = (generation.completion, len(generation.token_ids), generation.stop_reason)
    generated = ranks.gather(generated)
    completions = [generated[i] for i in range(len(prompts))]
    return score(tokenizer, prompts, completions, options)


def score(tokenizer: AnyTokenizer, prompts: list[GenPrompt], completions: list[tuple[str, int, str]],
          options: GenOptions) -> GenResult:
    """The rewards of each (completion, its token count, why it stopped), and their means."""
    rewards: Rewards = build_rewards(options.rewards, options.reward_weights, options.format_pattern,
                                     options.reward_errors)
    rewards.timeout_s = options.reward_timeout_s
    texts = [tokenizer.decode(p.ids) for p in prompts]  # the prompt as the rewards see it in training
    try:
        total, per = rewards.score(texts, [c[0] for c in completions], [p.row for p in prompts],
                                   [p.where for p in prompts])
    except EmberError as err:
        raise in_gen_terms(err) from None
    n = len(prompts)
    per, total = per.double(), total.double()  # means of 0/1 rewards as exact as the fraction they are
    metrics: dict[str, Any] = {name: float(per[:, k].mean()) for k, name in enumerate(rewards.names)}
    if len(rewards.names) > 1:  # the weighted sum, as GRPO's grpo/reward
        metrics["reward"] = float(total.mean())
    metrics.update({f"reward_errors/{name}": count for name, count in zip(rewards.names, rewards.errors) if count})
    metrics.update({"n": n, "completion_tokens": sum(c[1] for c in completions) / n,
                    "truncated": sum(c[2] == "length" for c in completions) / n,
                    "max_new_tokens": options.max_new_tokens})
    if options.stop:
        metrics["stop"] = list(options.stop)
    records = [{"where": p.where, "prompt": text, "completion": c[0], "stop_reason": c[2], "tokens": c[1],
                **({"answer": p.row["answer"]} if "answer" in p.row else {}),
                "rewards": {name: float(per[i, k]) for k, name in enumerate(rewards.names)}}
               for i, (p, text, c) in enumerate(zip(prompts, texts, completions))]
    return GenResult(metrics, records)


def data_label(spec: str, options: GenOptions) -> str:
    """What eval.json records as gen's data: a local file's absolute path; a generator with its rows."""
    if spec.startswith(GYM_PREFIX):
        return f"{spec} (seed {options.seed}, {options.gym_size} rows)"
    local = Path(spec).expanduser()
    return str(local.resolve()) if local.exists() else spec


def write_completions(target: str, records: list[dict[str, Any]]) -> None:
    """gen.completions: one JSON line per row, in the data's order; replaced whole (a local file through a
    temporary beside it, a URL as one object)."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    location = as_path(target)
    if isinstance(location, Path):
        location = location.expanduser()
        location.parent.mkdir(parents=True, exist_ok=True)
        tmp = location.with_name(location.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, location)
    else:
        location.write_text(text)
    print(f"wrote {len(records)} completions to {target}")
