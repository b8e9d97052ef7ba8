"""Chat SFT data: templates render as transformers renders them, and only assistant tokens are trained."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from data_testing import DataCfg
from tokenizers import decoders, models, pre_tokenizers, trainers


from ember import run as run_lib
from ember.constants import IGNORE_INDEX
from ember.data import chat, packing
from ember.data import prepare as prepare_lib
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer, load_tokenizer
from ember.errors import ConfigError, DataError

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


def _conversation(i: int) -> list[dict]:
    a, b, c, d = i % 7, (i * 3) % 5, (i * 5) % 9, i % 4
    return [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        {"role": "user", "content": f"And {c} plus {d}?"},
        {"role": "assistant", "content": f"{c} plus {d} is {c + d}."},
    ]


def _write_tokenizer(folder: Path, template: str | None, eos: str = "<|end_of_text|>") -> Path:
    """A byte-level BPE with Llama 3's and ChatML's special tokens, and a tokenizer_config.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for i in range(50) for m in _conversation(i)] + [m["content"] for m in CONVERSATION]
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
def _private_cache(cache_dir: Path) -> Path:
    return cache_dir  # token caches go to the test's folder, not the user's


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _chat_file(tmp_path: Path, n: int = 60) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": _conversation(i)}) + "\n" for i in range(n)))
    return path


# ---------------------------------------------------------------- ids equal transformers
@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_ids_equal_transformers_apply_chat_template(tmp_path: Path, template: str):
    folder = _write_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(str(folder))
    ours = chat.load_template("auto", tok)
    assert ours.name == str(folder / "tokenizer_config.json")
    encoder, hf = chat.chat_encoder(tok), _hf(folder)
    for messages in [CONVERSATION, _conversation(3), _conversation(11)[:2]]:
        ids, mask = chat.encode_conversation(ours, encoder, messages)
        assert ids == list(hf.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert chat.render(ours, messages) == hf.apply_chat_template(messages, tokenize=False)
        assert 0 < mask.sum() < len(ids)
    # The special tokens are single ids, not spelled out (they were read as specials).
    ids, _ = chat.encode_conversation(ours, encoder, CONVERSATION)
    end_of_turn = tok.tok.token_to_id("<|eot_id|>" if template == LLAMA3 else "<|im_end|>")
    assert ids.count(end_of_turn) == len(CONVERSATION)


def test_mask_equals_transformers_generation_mask(tmp_path: Path):
    # Transformers' {% generation %} tracking is a second, independent computation of the assistant tokens.
    folder = _write_tokenizer(tmp_path / "tok", LLAMA3_MARKED)
    tok = load_tokenizer(str(folder))
    template, encoder, hf = chat.load_template("auto", tok), chat.chat_encoder(tok), _hf(folder)
    for messages in [CONVERSATION, _conversation(5)]:
        ids, mask = chat.encode_conversation(template, encoder, messages)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"])


# ---------------------------------------------------------------- exact labels, independently
def _expected_llama3(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids and mask built piece by piece: each special token by id, each text by itself (the byte-level
    pre-tokenizer splits at these boundaries), assistant content + <|eot_id|> as targets."""
    special = tok.tok.token_to_id
    ids, mask = [special("<|begin_of_text|>")], [0]
    for m in messages:
        header = [special("<|start_header_id|>")] + tok.encode(m["role"]) + [special("<|end_header_id|>")] \
            + tok.encode("\n\n")
        body = tok.encode(m["content"].strip()) + [special("<|eot_id|>")]
        ids += header + body
        mask += [0] * len(header) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_multi_turn_labels_are_exact(tmp_path: Path):
    folder = _write_tokenizer(tmp_path / "tok", LLAMA3)
    tok = load_tokenizer(str(folder))
    template = chat.load_template("auto", tok)
    ids, mask = chat.encode_conversation(template, chat.chat_encoder(tok), CONVERSATION)
    expected_ids, expected_mask = _expected_llama3(tok, CONVERSATION)
    assert ids == expected_ids and mask.tolist() == expected_mask
    # The trained tokens decode to exactly the two answers and their end-of-turn tokens.
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "2 plus 3 is 5.<|eot_id|>4 plus 4 is 8.<|eot_id|>"

    # Through the loader (one conversation per sample): labels are the next token where it is an assistant
    # token, -100 everywhere else (system, user, headers, the EOS separator, padding).
    data = tmp_path / "one.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(4)))
    cfg = DataCfg(dataset=str(data), messages_field="messages", tokenizer=str(folder), packing=False,
                  val_fraction=0.0, num_workers=0)
    seq_len = len(expected_ids) + 8
    inputs, labels = next(build_loader(cfg, tok, seq_len=seq_len, micro_batch_size=2))
    row = expected_ids + [tok.eos_id] + [tok.pad_id] * (seq_len + 1 - len(expected_ids) - 1)
    want = [t if m else IGNORE_INDEX for t, m in zip(row[1:], (expected_mask + [0] * seq_len)[1:])]
    assert inputs.tolist() == [row[:-1]] * 2
    assert labels.tolist() == [want] * 2


# ---------------------------------------------------------------- built-in templates
@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_builtin_templates(tmp_path: Path, name: str):
    folder = _write_tokenizer(tmp_path / "tok", None)  # a base model's folder: no template of its own
    tok = load_tokenizer(str(folder))
    with pytest.raises(DataError, match=r"has no chat template .*set data\.chat_template to a built-in: llama3, chatml"):
        chat.load_template("auto", tok)
    template = chat.load_template(name, tok)
    assert template.name == f"built-in {name}"
    hf = _hf(folder)
    ids, mask = chat.encode_conversation(template, chat.chat_encoder(tok), CONVERSATION)
    assert ids == list(hf.apply_chat_template(CONVERSATION, chat_template=chat.BUILTIN_TEMPLATES[name],
                                              tokenize=True, return_dict=False))
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"  # ChatML's newline after <|im_end|> is not trained
    assert trained == f"2 plus 3 is 5.{end}4 plus 4 is 8.{end}"


def test_builtin_without_tokenizer_config(tmp_path: Path):
    folder = _write_tokenizer(tmp_path / "tok", None)
    (folder / "tokenizer_config.json").unlink()  # special tokens then come from the tokenizer itself
    tok = load_tokenizer(str(folder))
    template = chat.load_template("llama3", tok)
    assert dict(template.variables) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert chat.render(template, CONVERSATION[:1]).startswith("<|begin_of_text|><|start_header_id|>system")


# ---------------------------------------------------------------- bad input: one line each
def _rows_error(tmp_path: Path, rows: list, tok, **kwargs) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataCfg(dataset=str(path), messages_field="messages", val_fraction=0.0, num_workers=0, **kwargs)
    with pytest.raises(DataError) as info:
        build_loader(cfg, tok, seq_len=16, micro_batch_size=1)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_conversations_are_one_line_errors(tmp_path: Path):
    tok = load_tokenizer(str(_write_tokenizer(tmp_path / "tok", LLAMA3)))
    good = {"messages": CONVERSATION}
    no_assistant = {"messages": [{"role": "user", "content": "hi"}]}
    assert _rows_error(tmp_path, [good, no_assistant], tok) == (
        f"{tmp_path / 'bad.jsonl'} line 2 field 'messages' has no assistant message, and only assistant turns are "
        "trained; add one or remove the row")
    bot = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
    assert _rows_error(tmp_path, [bot], tok).endswith(
        "line 1 field 'messages' message 1 has role 'bot'; roles are system, user, assistant")
    assert _rows_error(tmp_path, [{"conversation": CONVERSATION}], tok).endswith(
        "line 1 has no 'messages' field (it has: conversation); set data.messages_field to the column holding the "
        "conversation's list of messages")
    assert "message 0 is not a" in _rows_error(tmp_path, [{"messages": [{"role": "user", "content": 3}]}], tok)
    assert "not a list of messages" in _rows_error(tmp_path, [{"messages": "hello"}], tok)


# Ignores add_generation_prompt: where the assistant's turn starts cannot be told from its header.
NO_GENERATION_PROMPT = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
# Rewrites earlier turns as the conversation grows (numbers them from the end).
REWRITES = ("{% for m in messages %}{{ (messages|length - loop.index0)|string + m['role'] + ': ' + m['content'] + "
            "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
# Drops the assistant's text.
DROPS = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'assistant: ' }}{% else %}{{ m['content'] }}"
         "{% endif %}{{ '<|eot_id|>' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.mark.parametrize("template, why", [
    (NO_GENERATION_PROMPT, "it ignores add_generation_prompt"),
    (REWRITES, "rendering the conversation up to message 1 is not a prefix of rendering all of it"),
    (DROPS, "assistant message 1's content is not in its rendered turn"),
])
def test_templates_that_cannot_mark_assistant_spans(tmp_path: Path, template: str, why: str):
    folder = _write_tokenizer(tmp_path / "tok", template)
    message = _rows_error(tmp_path, [{"messages": CONVERSATION[1:]}], load_tokenizer(str(folder)))
    assert message.startswith(f"chat template {folder / 'tokenizer_config.json'} cannot mark the assistant spans: {why}")


def test_template_errors_and_raise_exception(tmp_path: Path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}" + LLAMA3
    tok = load_tokenizer(str(_write_tokenizer(tmp_path / "tok", strict)))
    message = _rows_error(tmp_path, [{"messages": CONVERSATION}], tok)
    assert message.endswith("failed: Conversations must start with the user; fix the conversation or the template")


def test_document_mask_refuses_eos_inside_conversations(tmp_path: Path):
    # An instruct tokenizer whose eos_token is its end-of-turn marker: document masking would split turns.
    folder = _write_tokenizer(tmp_path / "tok", LLAMA3, eos="<|eot_id|>")
    message = _rows_error(tmp_path, [{"messages": _conversation(i)} for i in range(8)], load_tokenizer(str(folder)),
                          document_mask=True)
    assert message.startswith("the chat template writes the tokenizer's EOS <|eot_id|> inside conversations")


def test_config_errors(tmp_path: Path):
    data = _chat_file(tmp_path, 4)
    base = [f"output_dir={tmp_path / 'run'}", f"data.dataset={data}", "data.messages_field=messages"]
    cases = [
        (["data.chat_template=vicuna"], "data.chat_template 'vicuna' is not one of auto, llama3, chatml"),
        (["data.prompt_field=prompt"], "data.messages_field (chat rows) and data.prompt_field"),
        (["data.dataset=synthetic"], "data.messages_field (chat SFT) reads conversations, and synthetic tokens"),
        (["data.streaming=true"], "data.messages_field (chat SFT) reads whole files; set data.streaming=false"),
    ]
    for extra, start in cases:
        with pytest.raises(ConfigError) as info:
            run_lib.load_config("debug", base + extra)
        assert str(info.value).startswith(start) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^data\.packing=false pads each document"):
        run_lib.load_config("debug", [f"output_dir={tmp_path / 'run'}", "data.dataset=synthetic", "data.packing=false"])
    # No tokenizer, or no conversations: refused when the run builds its tokenizer, before the model.
    with pytest.raises(DataError, match=r"^data\.messages_field \(chat SFT\) needs the model's tokenizer and chat "
                                        r"template: set model\.init_from=DIR"):
        build_tokenizer(run_lib.load_config("debug", base).data, 8192)
    with pytest.raises(DataError, match=r"not data\.dataset=embedded; set data\.dataset=chat\.jsonl"):
        build_tokenizer(DataCfg(messages_field="messages", tokenizer="tok"), 8192)


def _hf_llama_folder(folder: Path, template: str | None) -> Path:
    """What `model.init_from=DIR` reads at config time: Llama 3.2 1B's config.json (and the tokenizer)."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                tie_word_embeddings=True, rms_norm_eps=1e-5,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                ).save_pretrained(str(folder))
    return _write_tokenizer(folder, template)


@pytest.mark.parametrize("recipe", ["llama3.2-1b-sft", "llama2-7b-sft"])
def test_sft_recipes(tmp_path: Path, recipe: str):
    data = _chat_file(tmp_path, 4)
    out = f"output_dir={tmp_path / 'run'}"
    cfg = run_lib.load_config(recipe, [out])  # loads alone, so `ember recipes` lists it
    assert (cfg.data.messages_field, cfg.optim.lr, cfg.schedule.name) == ("messages", 2e-5, "cosine")
    assert cfg.global_batch_size == 64 and cfg.data.packing and cfg.data.document_mask
    if recipe == "llama2-7b-sft":
        assert cfg.seq_len == 4096 and cfg.data.chat_template == "chatml"
        return
    # Without model.init_from: one line, when the tokenizer is built (the trainer's step before the model).
    with pytest.raises(DataError, match=r"^data\.messages_field \(chat SFT\) needs the model's tokenizer"):
        build_tokenizer(run_lib.load_config(recipe, [out, f"data.dataset={data}"]).data, 128256)
    # With it: the architecture and the tokenizer are the folder's.
    folder = _hf_llama_folder(tmp_path / "llama", None)
    cfg = run_lib.load_config(recipe, [out, f"model.init_from={folder}", f"data.dataset={data}"])
    assert cfg.data.tokenizer == str(folder) and cfg.model.init_from == str(folder)
    args = run_lib.model_choice(cfg).args
    assert (args.dim, args.n_layers, args.vocab_size) == (2048, 16, 128256)
    tok = build_tokenizer(cfg.data, args.vocab_size)
    assert chat.load_template(cfg.data.chat_template, tok).name == "built-in llama3"
    with pytest.raises(ConfigError, match=r"^model\.init_from '.*nowhere' does not exist"):
        run_lib.load_config(recipe, [out, f"model.init_from={tmp_path / 'nowhere'}", f"data.dataset={data}"])


def test_parquet_and_json_rows_read_as_jsonl(tmp_path: Path):
    import datasets

    tok = load_tokenizer(str(_write_tokenizer(tmp_path / "tok", CHATML)))
    rows = [{"messages": _conversation(i)} for i in range(30)]
    rows[3]["messages"][0]["name"] = "ann"  # parquet gives every other message name=None: dropped again
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    as_json = tmp_path / "j" / "c.json"
    as_json.parent.mkdir()
    as_json.write_text(json.dumps(rows))
    parquet = tmp_path / "p" / "c.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    # val_fraction=0: the same documents whatever the file's name (its keys pick the split)
    streams = [prepare_lib.token_stream(DataCfg(dataset=str(p), messages_field="messages", val_fraction=0.0), tok,
                                        "train") for p in (jsonl, as_json, parquet)]
    for stream in streams[1:]:
        assert np.array_equal(stream.tokens, streams[0].tokens)
        assert np.array_equal(stream.loss_mask, streams[0].loss_mask)
    assert streams[0].num_documents == 30
    ids, mask = chat.encode_conversation(chat.load_template("auto", tok), chat.chat_encoder(tok), rows[0]["messages"])
    assert streams[0].tokens[: len(ids)].tolist() == ids and streams[0].tokens[len(ids)] == tok.eos_id


# ---------------------------------------------------------------- packing on and off
def test_packing_false_pads_one_conversation_per_sample(tmp_path: Path):
    folder = _write_tokenizer(tmp_path / "tok", CHATML)
    tok = load_tokenizer(str(folder))
    cfg = DataCfg(dataset=str(_chat_file(tmp_path, 40)), messages_field="messages", packing=False,
                  val_fraction=0.0, num_workers=0)
    template = chat.load_template("auto", tok)
    encoded = [chat.encode_conversation(template, chat.chat_encoder(tok), _conversation(i)) for i in range(40)]
    lengths = [len(ids) + 1 for ids, _ in encoded]  # + the EOS separator
    seq_len = max(lengths) + 3
    loader = build_loader(cfg, tok, seq_len=seq_len, micro_batch_size=4)
    assert loader.num_samples == 40
    inputs, labels = next(loader)
    for row_in, row_lab in zip(inputs.tolist(), labels.tolist()):
        n = row_in.index(tok.eos_id) + 1  # the conversation, then only padding
        assert n in lengths and row_in[n:] == [tok.pad_id] * (seq_len - n)
        assert all(label == IGNORE_INDEX for label in row_lab[n - 2:])  # from the EOS separator on
        assert sum(label != IGNORE_INDEX for label in row_lab) > 0
    # Packed (the default): the same conversations end to end, no padding at all.
    packed = build_loader(DataCfg(dataset=cfg.dataset, messages_field="messages", val_fraction=0.0, num_workers=0),
                          tok, seq_len=seq_len, micro_batch_size=4)
    assert packed.num_tokens == sum(lengths) and packed.num_samples == sum(lengths) // (seq_len + 1)
    assert tok.pad_id not in torch.cat(next(packed)).tolist()
    # A conversation longer than a sample is cut; one with no assistant token left is dropped.
    first_target = min(int(np.flatnonzero(mask)[0]) for _, mask in encoded)
    short = build_loader(cfg, tok, seq_len=first_target, micro_batch_size=1)  # one target token left in each
    assert short.num_samples == 40
    inputs, labels = next(short)
    assert tok.pad_id not in inputs.tolist() and (labels != IGNORE_INDEX).sum() == 1
    pieces = [(np.asarray(ids), mask) for ids, mask in encoded]
    assert packing.pad_pieces(pieces, first_target, tok.pad_id)[2] == 0  # none left: all dropped


def test_packed_chat_keeps_resumable_state(tmp_path: Path):
    tok = load_tokenizer(str(_write_tokenizer(tmp_path / "tok", LLAMA3)))
    cfg = DataCfg(dataset=str(_chat_file(tmp_path, 60)), messages_field="messages", document_mask=True, num_workers=0)
    loader = build_loader(cfg, tok, seq_len=32, micro_batch_size=2)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    again = build_loader(cfg, tok, seq_len=32, micro_batch_size=2)
    again.load_state_dict(state)
    for (i, l), (i2, l2) in zip(expected, [next(again) for _ in range(3)]):
        assert torch.equal(i, i2) and torch.equal(l, l2)
        assert 0 < (l != IGNORE_INDEX).sum() < l.numel()


# ---------------------------------------------------------------- a short run: the assistant loss falls
@pytest.mark.slow
def test_chat_sft_run_lowers_assistant_loss(tmp_path: Path):
    from ember.train import Trainer

    folder = _write_tokenizer(tmp_path / "tok", LLAMA3)
    cfg = run_lib.load_config("debug", [
        f"output_dir={tmp_path / 'run'}", "metrics.console=false", "model.n_layers=2", "model.vocab_size=512", "max_steps=30",
        "seq_len=64", "global_batch_size=8", "micro_batch_size=8", "logging_steps=5", "schedule.warmup_steps=3",
        "optim.lr=3e-3", f"data.dataset={_chat_file(tmp_path, 200)}", "data.messages_field=messages",
        f"data.tokenizer={folder}", "data.document_mask=true", "checkpoint.interval=0", "eval_batches=2",
    ])
    summary = Trainer(cfg).train()
    # The loss is over assistant tokens only; it starts near uniform over the model's vocabulary.
    assert summary["first_loss"] == pytest.approx(math.log(512), abs=1.0)
    assert summary["final_loss_avg"] < 2.0  # from ~6.2 nats


@pytest.mark.slow
def test_lora_chat_sft_lowers_assistant_loss_with_the_base_frozen(tmp_path: Path):
    """Issue 15's LoRA SFT: adapters on a frozen base (a 2-step run of the same shape), trained on conversations."""
    from ember.train import Trainer

    folder = _write_tokenizer(tmp_path / "tok", LLAMA3)
    common = ["metrics.console=false", "model.n_layers=2", "model.vocab_size=512", "seq_len=64", "global_batch_size=8",
              "micro_batch_size=8", "logging_steps=5", f"data.dataset={_chat_file(tmp_path, 200)}",
              "data.messages_field=messages", f"data.tokenizer={folder}", "data.document_mask=true", "eval_batches=1"]
    Trainer(run_lib.load_config("debug", common + [f"output_dir={tmp_path / 'base'}", "max_steps=2"])).train()
    trainer = Trainer(run_lib.load_config("debug", common + [
        f"output_dir={tmp_path / 'lora'}", "max_steps=30", "optim.lr=1e-2", "schedule.warmup_steps=3",
        f"model.init_from={tmp_path / 'base'}", "lora.rank=8", "lora.alpha=16"]))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    summary = trainer.train()
    assert summary["final_loss_avg"] < summary["first_loss"] - 1.0
    assert frozen and all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
