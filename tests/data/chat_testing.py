"""Shared by the chat tests (test_chat.py, test_chat_sft.py): a byte-level BPE with Llama 3's and ChatML's special
tokens, the templates, and conversation files. (Imported by name, as data_testing.py is.)"""

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ember.data import chat

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
# Meta-Llama-3-8B-Instruct's template, as its tokenizer_config.json writes it.
LLAMA3 = chat.BUILTIN_TEMPLATES["llama3"]
CHATML = chat.BUILTIN_TEMPLATES["chatml"]
# The Llama 3 template with transformers' generation markers: transformers' own assistant mask to compare with.
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "4 plus 4 is 8."},
]


def conversation(i: int) -> list[dict]:
    a, b, c, d = i % 7, (i * 3) % 5, (i * 5) % 9, i % 4
    return [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        {"role": "user", "content": f"And {c} plus {d}?"},
        {"role": "assistant", "content": f"{c} plus {d} is {c + d}."},
    ]


def write_tokenizer(folder: Path, template: str | None, eos: str = "<|end_of_text|>") -> Path:
    """A byte-level BPE with Llama 3's and ChatML's special tokens, and a tokenizer_config.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for i in range(50) for m in conversation(i)] + [m["content"] for m in CONVERSATION]
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": eos, "pad_token": "<|pad|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(autouse=True)
def private_cache(cache_dir: Path) -> Path:
    return cache_dir  # token caches go to the test's folder, not the user's


def chat_file(tmp_path: Path, n: int = 60) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(n)))
    return path
