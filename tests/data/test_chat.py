"""Chat SFT data: templates render as transformers renders them, and only assistant tokens are trained."""

import json
from pathlib import Path

import numpy as np
import pytest
from chat_testing import (  # noqa: F401
    CHATML,
    CONVERSATION,
    LLAMA3,
    LLAMA3_MARKED,
    chat_file,
    conversation,
    private_cache,  # private_cache: autouse, token caches in the test's folder
    write_tokenizer,
)
from data_testing import DataCfg

from ember.constants import IGNORE_INDEX
from ember.data import chat, prepare as prepare_lib
from ember.data.loader import build_loader
from ember.data.tokenizer import build_tokenizer, load_tokenizer
from ember.errors import ConfigError, DataError
from ember.train import run as run_lib


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# ---------------------------------------------------------------- ids equal transformers
@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_ids_equal_transformers_apply_chat_template(tmp_path: Path, template: str):
    folder = write_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(str(folder))
    ours = chat.load_template("auto", tok)
    assert ours.name == str(folder / "tokenizer_config.json")
    encoder, hf = chat.chat_encoder(tok), _hf(folder)
    for messages in [CONVERSATION, conversation(3), conversation(11)[:2]]:
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
    folder = write_tokenizer(tmp_path / "tok", LLAMA3_MARKED)
    tok = load_tokenizer(str(folder))
    template, encoder, hf = chat.load_template("auto", tok), chat.chat_encoder(tok), _hf(folder)
    for messages in [CONVERSATION, conversation(5)]:
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
    folder = write_tokenizer(tmp_path / "tok", LLAMA3)
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
    folder = write_tokenizer(tmp_path / "tok", None)  # a base model's folder: no template of its own
    tok = load_tokenizer(str(folder))
    with pytest.raises(DataError,
                       match=r"has no chat template .*set data\.chat_template to a built-in: llama3, chatml"):
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
    folder = write_tokenizer(tmp_path / "tok", None)
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
    tok = load_tokenizer(str(write_tokenizer(tmp_path / "tok", LLAMA3)))
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
    folder = write_tokenizer(tmp_path / "tok", template)
    message = _rows_error(tmp_path, [{"messages": CONVERSATION[1:]}], load_tokenizer(str(folder)))
    assert message.startswith(f"chat template {folder / 'tokenizer_config.json'} "
                              f"cannot mark the assistant spans: {why}")


def test_template_errors_and_raise_exception(tmp_path: Path):
    strict = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}"
              "{% endif %}" + LLAMA3)
    tok = load_tokenizer(str(write_tokenizer(tmp_path / "tok", strict)))
    message = _rows_error(tmp_path, [{"messages": CONVERSATION}], tok)
    assert message.endswith("failed: Conversations must start with the user; fix the conversation or the template")


def test_document_mask_refuses_eos_inside_conversations(tmp_path: Path):
    # An instruct tokenizer whose eos_token is its end-of-turn marker: document masking would split turns.
    folder = write_tokenizer(tmp_path / "tok", LLAMA3, eos="<|eot_id|>")
    message = _rows_error(tmp_path, [{"messages": conversation(i)} for i in range(8)], load_tokenizer(str(folder)),
                          document_mask=True)
    assert message.startswith("the chat template writes the tokenizer's EOS <|eot_id|> inside conversations")


def test_config_errors(tmp_path: Path):
    data = chat_file(tmp_path, 4)
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
    return write_tokenizer(folder, template)


@pytest.mark.parametrize("recipe", ["llama3.2-1b-sft", "llama2-7b-sft"])
def test_sft_recipes(tmp_path: Path, recipe: str):
    data = chat_file(tmp_path, 4)
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

    tok = load_tokenizer(str(write_tokenizer(tmp_path / "tok", CHATML)))
    rows = [{"messages": conversation(i)} for i in range(30)]
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
