"""Evaluation: log-likelihood scoring (scoring.py), the tasks of `ember eval` and the trainer's eval.tasks
(tasks.py), the lm-evaluation-harness adapter (harness.py), and eval on a mesh (distributed.py, sharded.py).
The command line is ember/commands/eval.py."""

from ember.eval.scoring import Score, loglikelihood, rolling_logprob
from ember.eval.tasks import TASKS, boolq, choice, lambada, ppl

__all__ = ["Score", "TASKS", "boolq", "choice", "lambada", "loglikelihood", "ppl", "rolling_logprob"]
