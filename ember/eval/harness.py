"""An lm-evaluation-harness `LM` over an ember model, so any harness task runs on ember checkpoints without
converting them: `ember eval PATH --harness TASKS [--include-path DIR]`, or from Python:

    from ember.eval.harness import EmberLM, simple_evaluate
    results = simple_evaluate(EmberLM(model, tokenizer), ["lambada_openai"])

lm-eval is an optional extra (`pip install -e '.[eval]'`). The requests are scored by ember.eval.scoring, whose
definitions are the harness's (HFLM's): the same context/continuation split, left truncation to the context,
rolling windows from lm_eval.utils, and generation by ember.generate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from ember.errors import ConfigError, did_you_mean
from ember.eval.distributed import EvalRanks
from ember.eval.scoring import encode_pair, score_tokens
from ember.generate import generate

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from ember.data.tokenizer import AnyTokenizer

try:  # an optional dependency: only this module needs it
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - exercised by the error below
    LM = object  # type: ignore[misc,assignment]


def _require_lm_eval() -> None:
    if LM is object:
        raise ConfigError("the lm-evaluation-harness adapter needs lm-eval: pip install -e '.[eval]'")


class EmberLM(LM):  # type: ignore[misc]
    """lm-eval's `LM` interface (loglikelihood, loglikelihood_rolling, generate_until), batched."""

    def __init__(self, model: nn.Module, tokenizer: AnyTokenizer, batch_size: int = 16, max_gen_toks: int = 256,
                 ranks: EvalRanks = EvalRanks()):
        """`ranks`: this process's place when the model is sharded over a mesh (ember.eval.distributed). Every
        rank then sees every request, as one process would (lm-eval is told of one rank), and the scoring shares
        the forwards out over the data-parallel ranks."""
        _require_lm_eval()
        super().__init__()
        self.model, self.tokenizer, self.batch_size, self.max_gen_toks = model, tokenizer, batch_size, max_gen_toks
        self.ranks = ranks
        self.max_length = model.args.max_seq_len

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tokenizer, *req.args) for req in requests]
        return [(s.logprob, s.greedy) for s in score_tokens(self.model, pairs, self.batch_size, self.ranks)]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []  # every request's windows in one scoring pass, so batches fill up
        for n, req in enumerate(requests):
            for context, continuation in (make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tokenizer.encode(req.args[0]), prefix_token=self.tokenizer.eos_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((list(context), list(continuation)))
                owner.append(n)
        results = [0.0] * len(requests)
        for n, score in zip(owner, score_tokens(self.model, windows, self.batch_size, self.ranks)):
            results[n] += score.logprob
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for req in requests:  # one at a time: each request has its own stop strings and length
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sampled = kwargs.get("do_sample", False)
            ids = self.tokenizer.encode(context)
            new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = ids[-(self.max_length - new):]  # left-truncated so the continuation fits, as HFLM does
            (result,) = generate(self.model, self.tokenizer, [ids], max_new_tokens=new,
                                 temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0, stop=until)
            outputs.append(result.completion)
        return outputs


def task_manager(tasks: list[str], include_path: Optional[str] = None) -> TaskManager:
    """lm-eval's TaskManager with every name of `tasks` checked, before any model is loaded: a registered task,
    group or tag, or a task YAML file. With include_path only the tasks found there are indexed (indexing every
    default task takes ~15 s)."""
    _require_lm_eval()
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=include_path is None)
    for name in tasks:
        if name in manager.all_tasks or Path(name).is_file():
            continue
        close = did_you_mean(name, manager.all_tasks, cutoff=0.7)
        if include_path:
            raise ConfigError(f"lm-eval task '{name}' is not defined in --include-path {include_path}{close}; give a "
                              "task name one of its YAMLs defines (task: NAME), or drop --include-path for lm-eval's "
                              "registered tasks")
        raise ConfigError(f"'{name}' is not an lm-eval task{close}; give a registered task name (`lm-eval ls tasks` "
                          "lists them), or --include-path DIR with a folder of task YAMLs that defines it")
    return manager


def simple_evaluate(lm: EmberLM, tasks: list[str], include_path: Optional[str] = None, limit: Optional[int] = None,
                    manager: Optional[TaskManager] = None, **kwargs: Any) -> dict:
    """lm_eval.simple_evaluate on `lm`; `manager`: task_manager(tasks, include_path), made here if not given."""
    _require_lm_eval()
    from lm_eval import simple_evaluate as harness_evaluate

    manager = manager or task_manager(tasks, include_path)
    return harness_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, **kwargs)
