"""What task=grpo's tests share: a word-level tokenizer small enough that a tiny model samples every word, prompts,
reward functions importable as `tests.finetune.grpo_fixtures:NAME` (grpo.rewards takes module:function), and a
sampler that stands in for the policy's where a test needs the same rollouts whatever the layout."""

import json
from pathlib import Path

WORDS = ["yes", "no", "maybe", "a", "b", "c", "say", "?"]
SPECIALS = ["<s>", "</s>"]


def word_tokenizer(folder: Path) -> str:
    """A WordLevel tokenizer.json (<s>, </s>, the WORDS, [UNK]: 11 ids) in FOLDER; returns the folder as
    data.tokenizer takes it."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + ["[UNK]"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # words joined by spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return str(folder)


def say_prompts(path: Path, n: int = 16) -> str:
    """N prompts asking for `yes`, with the answer the exact reward compares against."""
    rows = [{"prompt": " ".join(["say"] + ["a", "b", "c"][: 1 + i % 3] + ["?"]), "answer": "yes"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def yes_fraction(prompt: str, completion: str, row: dict) -> float:
    """The share of the completion's words that are `yes` (0 for an empty completion)."""
    words = completion.split()
    return sum(w == "yes" for w in words) / len(words) if words else 0.0


def raises(prompt: str, completion: str, row: dict) -> float:
    raise ValueError("no score for this")


def nan(prompt: str, completion: str, row: dict) -> float:
    return float("nan")


def sleeps(prompt: str, completion: str, row: dict) -> float:
    import time

    time.sleep(5)
    return 1.0


def fixed_sample(model, tokenizer, prompts, group_size, **kwargs):
    """ember.finetune.grpo_rollout.sample's stand-in: completions that depend on the prompt and the completion's
    place in its group only (not on the model, the seed or the layout), of different lengths, some ending in EOS."""
    from ember.finetune.grpo_rollout import Rollouts

    rows = [list(p) for p in prompts for _ in range(group_size)]
    completions, truncated = [], []
    for i, prompt in enumerate(rows):
        k = i % group_size
        length = 2 + (sum(prompt) + k) % 4
        ids = [2 + (sum(prompt) * 7 + k * 3 + j) % len(WORDS) for j in range(length)]
        ends = (k + len(prompt)) % 3 != 0
        completions.append(ids + ([1] if ends else []))
        truncated.append(not ends)
    texts = [tokenizer.decode(c[:-1] if c[-1] == 1 else c) for c in completions]
    return Rollouts(rows, completions, texts, truncated)
