"""Chat SFT data in the loader and in training: packing on and off, resumable packed state, and short runs (full
and LoRA) whose assistant-only loss falls."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_testing import CHATML, LLAMA3, chat_file, conversation, private_cache, write_tokenizer  # noqa: F401
from data_testing import DataCfg

from ember.constants import IGNORE_INDEX
from ember.data import chat, packing
from ember.data.loader import build_loader
from ember.data.tokenizer import load_tokenizer
from ember.train import run as run_lib


# ---------------------------------------------------------------- packing on and off
def test_packing_false_pads_one_conversation_per_sample(tmp_path: Path):
    folder = write_tokenizer(tmp_path / "tok", CHATML)
    tok = load_tokenizer(str(folder))
    cfg = DataCfg(dataset=str(chat_file(tmp_path, 40)), messages_field="messages", packing=False,
                  val_fraction=0.0, num_workers=0)
    template = chat.load_template("auto", tok)
    encoded = [chat.encode_conversation(template, chat.chat_encoder(tok), conversation(i)) for i in range(40)]
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
    tok = load_tokenizer(str(write_tokenizer(tmp_path / "tok", LLAMA3)))
    cfg = DataCfg(dataset=str(chat_file(tmp_path, 60)), messages_field="messages", document_mask=True, num_workers=0)
    loader = build_loader(cfg, tok, seq_len=32, micro_batch_size=2)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    again = build_loader(cfg, tok, seq_len=32, micro_batch_size=2)
    again.load_state_dict(state)
    for (tokens, labels), (tokens2, labels2) in zip(expected, [next(again) for _ in range(3)]):
        assert torch.equal(tokens, tokens2) and torch.equal(labels, labels2)
        assert 0 < (labels != IGNORE_INDEX).sum() < labels.numel()


# ---------------------------------------------------------------- a short run: the assistant loss falls
@pytest.mark.slow
def test_chat_sft_run_lowers_assistant_loss(tmp_path: Path):
    from ember.train.trainer import Trainer

    folder = write_tokenizer(tmp_path / "tok", LLAMA3)
    cfg = run_lib.load_config("debug", [
        f"output_dir={tmp_path / 'run'}", "metrics.console=false", "model.n_layers=2", "model.vocab_size=512",
        "max_steps=30",
        "seq_len=64", "global_batch_size=8", "micro_batch_size=8", "logging_steps=5", "schedule.warmup_steps=3",
        "optim.lr=3e-3", f"data.dataset={chat_file(tmp_path, 200)}", "data.messages_field=messages",
        f"data.tokenizer={folder}", "data.document_mask=true", "checkpoint.interval=0", "eval_batches=2",
    ])
    summary = Trainer(cfg).train()
    # The loss is over assistant tokens only; it starts near uniform over the model's vocabulary.
    assert summary["first_loss"] == pytest.approx(math.log(512), abs=1.0)
    assert summary["final_loss_avg"] < 2.0  # from ~6.2 nats


@pytest.mark.slow
def test_lora_chat_sft_lowers_assistant_loss_with_the_base_frozen(tmp_path: Path):
    """Issue 15's LoRA SFT: adapters on a frozen base (a 2-step run of the same shape), trained on conversations."""
    from ember.train.trainer import Trainer

    folder = write_tokenizer(tmp_path / "tok", LLAMA3)
    common = ["metrics.console=false", "model.n_layers=2", "model.vocab_size=512", "seq_len=64", "global_batch_size=8",
              "micro_batch_size=8", "logging_steps=5", f"data.dataset={chat_file(tmp_path, 200)}",
              "data.messages_field=messages", f"data.tokenizer={folder}", "data.document_mask=true", "eval_batches=1"]
    Trainer(run_lib.load_config("debug", common + [f"output_dir={tmp_path / 'base'}", "max_steps=2"])).train()
    trainer = Trainer(run_lib.load_config("debug", common + [
        f"output_dir={tmp_path / 'lora'}", "max_steps=30", "optim.lr=1e-2", "schedule.warmup_steps=3",
        f"model.init_from={tmp_path / 'base'}", "lora.rank=8", "lora.alpha=16"]))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    summary = trainer.train()
    assert summary["final_loss_avg"] < summary["first_loss"] - 1.0
    assert frozen and all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
