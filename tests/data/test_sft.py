"""SFT data: prompt tokens are read but masked out of the loss (label -100), through every path that packs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_testing import DataCfg

from ember.config import MixtureSource
from ember.constants import IGNORE_INDEX
from ember.data import prepare as prepare_lib
from ember.data.loader import build_loader
from ember.data.prepare import load_prepared, prepare
from ember.data.tokenizer import Tokenizer

ROWS = [{"prompt": f"Question {i}: what is {i} plus {i}?\nAnswer:", "response": f" {2 * i}."} for i in range(120)]


def _sft_file(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_prompt_tokens_are_masked_out(tmp_path: Path, small_tokenizer: Tokenizer):
    cfg = DataCfg(dataset=str(_sft_file(tmp_path)), text_field="response", prompt_field="prompt", num_workers=0)
    stream = prepare_lib.token_stream(cfg, small_tokenizer, "train")
    assert stream.loss_mask is not None and len(stream.loss_mask) == len(stream.tokens)
    # Walk the stream document by document: the masked tokens decode to exactly the prompts.
    eos = np.flatnonzero(stream.tokens == small_tokenizer.eos_id)
    start = 0
    prompts, responses = [], []
    for end in eos[:5]:
        doc, mask = stream.tokens[start : end + 1], stream.loss_mask[start : end + 1]
        prompts.append(small_tokenizer.decode(doc[mask == 0].tolist()))
        responses.append(small_tokenizer.decode(doc[mask == 1][:-1].tolist()))  # the EOS is a target too
        assert mask[-1] == 1
        start = end + 1
    known = {r["prompt"]: r["response"] for r in ROWS}
    assert all(known[p] == r for p, r in zip(prompts, responses))
    # The loader turns mask 0 into label -100, shifted with the labels.
    loader = build_loader(cfg, small_tokenizer, seq_len=32, micro_batch_size=4)
    inputs, labels = next(loader)
    ignored = labels == IGNORE_INDEX
    assert 0 < ignored.float().mean() < 1
    assert torch.equal(labels[~ignored], torch.cat([inputs[:, 1:], labels[:, -1:]], dim=1)[~ignored])


def test_prepared_and_mixed_sft_keep_their_masks(tmp_path: Path, small_tokenizer: Tokenizer):
    sft = _sft_file(tmp_path)
    cfg = DataCfg(dataset=str(sft), text_field="response", prompt_field="prompt")
    prepare(cfg, small_tokenizer, tmp_path / "prepared")
    prepared = load_prepared(tmp_path / "prepared", "train", small_tokenizer)
    direct = prepare_lib.token_stream(cfg, small_tokenizer, "train")
    assert np.array_equal(np.asarray(prepared.loss_mask), direct.loss_mask)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"response": "plain text to learn " * 5}) + "\n" for _ in range(50)))
    mix = DataCfg(mixture=[MixtureSource(str(tmp_path / "prepared"), 1.0), MixtureSource(str(plain), 1.0)],
                  text_field="response", num_workers=0)
    loader = build_loader(mix, small_tokenizer, seq_len=16, micro_batch_size=8)
    labels = torch.cat([next(loader)[1] for _ in range(10)])
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).all(dim=1).any()


def test_sft_needs_the_prompt_field(tmp_path: Path, small_tokenizer: Tokenizer):
    cfg = DataCfg(dataset=str(_sft_file(tmp_path)), text_field="response", prompt_field="question")
    with pytest.raises(ValueError, match=r"sft\.jsonl line 1 has no 'question' field \(it has: prompt, response\); "
                                         r"set data\.prompt_field"):  # the key that names it, not text_field
        prepare_lib.token_stream(cfg, small_tokenizer, "train")
    txt = tmp_path / "notes.txt"
    txt.write_text("plain")
    with pytest.raises(ValueError, match=r"notes\.txt is plain text, but data\.prompt_field is set"):
        prepare_lib.token_stream(DataCfg(dataset=str(txt), prompt_field="prompt"), small_tokenizer, "train")
