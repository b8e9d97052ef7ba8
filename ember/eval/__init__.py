"""Evaluation: log-likelihood scoring (scoring.py) and the tasks of `ember eval` (tasks.py)."""

from ember.eval.scoring import Score, loglikelihood, rolling_logprob
from ember.eval.tasks import TASKS, boolq, choice, lambada, ppl

__all__ = ["Score", "TASKS", "boolq", "choice", "lambada", "loglikelihood", "ppl", "rolling_logprob"]
