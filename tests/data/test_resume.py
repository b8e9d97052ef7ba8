"""Exact resume: after restoring a loader's state in a new process, the next batches are token for
token those of the uninterrupted run, for every source type and with or without the prefetch thread;
and a run saved at 2 data-parallel ranks continues the same global order at 1 and at 4 ranks."""

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.config import DataConfig, MixtureSource
from ember.data.loader import build_loader
from ember.data.prepare import prepare
from ember.data.tokenizer import build_tokenizer

HERE = Path(__file__).parent
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bankers".split()


def _write_jsonl(path: Path, n: int, seed: int, prefix: str) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": prefix + " " + " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
                            + "\n" for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CACHE", str(root / "cache"))  # read by the worker processes too
        yield _make_data(root)


def _make_data(root: Path) -> Path:
    a = _write_jsonl(root / "a.jsonl", 400, 0, "alpha")
    b = _write_jsonl(root / "b.jsonl", 200, 1, "beta")
    _write_jsonl(root / "c.jsonl", 30, 2, "gamma")  # small: a stream of it runs through several epochs
    tok_dir = root / "tok"
    subprocess.run([sys.executable, "-m", "ember", "data", "tokenizer", "train", str(a), str(tok_dir),
                    "--vocab-size", "320"], check=True, capture_output=True)
    cfg = DataConfig(dataset=str(b), tokenizer=str(tok_dir / "tokenizer.json"))
    prepare(cfg, build_tokenizer(cfg, 512), root / "prepared")
    return root


def _spec(data_dir: Path, kind: str, workers: int) -> dict:
    tok = str(data_dir / "tok" / "tokenizer.json")
    base = {"tokenizer": tok, "num_workers": workers, "seq_len": 16, "micro_batch_size": 4, "dp_rank": 0,
            "dp_world": 1, "vocab_size": 512}
    if kind == "jsonl":
        return {**base, "dataset": str(data_dir / "a.jsonl")}
    if kind == "prepared":
        return {**base, "dataset": str(data_dir / "prepared")}
    if kind == "stream":
        return {**base, "dataset": str(data_dir / "c.jsonl"), "streaming": True, "shuffle_buffer": 8}
    if kind == "mixture":
        return {**base, "mixture": [{"source": str(data_dir / "a.jsonl"), "weight": 0.7},
                                    {"source": str(data_dir / "prepared"), "weight": 0.3}]}
    return {**base, "dataset": "synthetic", "tokenizer": None}


def _in_process(spec: dict, n: int) -> dict:
    spec = dict(spec)
    loader_args = {k: spec.pop(k) for k in ("seq_len", "micro_batch_size", "dp_rank", "dp_world", "vocab_size")}
    cfg = DataConfig(**{k: v for k, v in spec.items() if k != "mixture"},
                     mixture=[MixtureSource(**m) for m in spec.get("mixture", [])])
    tok = build_tokenizer(cfg, 512) if cfg.dataset != "synthetic" else None
    loader = build_loader(cfg, tok, **loader_args)
    batches = [next(loader) for _ in range(n)]
    loader.close()
    return {"inputs": [b[0] for b in batches], "labels": [b[1] for b in batches], "state": loader.state_dict()}


def _resumed_in_new_process(tmp: Path, spec: dict, n: int, state: dict) -> dict:
    spec_path, state_path, out = tmp / "spec.json", tmp / "state.pt", tmp / "out.pt"
    spec_path.write_text(json.dumps(spec))
    torch.save(state, state_path)
    cmd = [sys.executable, str(HERE / "resume_worker.py"), str(spec_path), str(out), str(n), str(state_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "prepared", "mixture", "synthetic", "stream"])
@pytest.mark.parametrize("workers", [0, 1])
def test_resume_in_a_new_process_continues_exactly(data_dir, tmp_path, kind, workers):
    spec = _spec(data_dir, kind, workers)
    # 40 batches of 4 x 17 tokens: more than one epoch of b.jsonl's samples, so an epoch boundary is crossed.
    full = _in_process(spec, 40)
    first = _in_process(spec, 13)
    rest = _resumed_in_new_process(tmp_path, spec, 27, first["state"])
    assert len(rest["inputs"]) == 27
    for i in range(13):
        assert torch.equal(first["inputs"][i], full["inputs"][i])
    for i in range(27):
        assert torch.equal(rest["inputs"][i], full["inputs"][13 + i]), f"batch {13 + i}"
        assert torch.equal(rest["labels"][i], full["labels"][13 + i])
    assert rest["state"] == full["state"]


def _loaders(data_dir: Path, kind: str, world: int, mb: int) -> list:
    spec = _spec(data_dir, kind, 0)
    cfg = DataConfig(**{k: v for k, v in spec.items() if k in DataConfig.__dataclass_fields__ and k != "mixture"},
                     mixture=[MixtureSource(**m) for m in spec.get("mixture", [])])
    tok = build_tokenizer(cfg, 512) if cfg.dataset != "synthetic" else None
    return [build_loader(cfg, tok, seq_len=16, micro_batch_size=mb, dp_rank=r, dp_world=world, vocab_size=512)
            for r in range(world)]


def _global_batches(loaders: list, n: int) -> list[torch.Tensor]:
    return [torch.cat([next(loader)[0] for loader in loaders]) for _ in range(n)]


@pytest.mark.parametrize("kind", ["prepared", "mixture", "jsonl"])
def test_resume_on_another_number_of_ranks_keeps_the_global_order(data_dir, kind):
    # Global batch 8: 2 ranks x 4, then 1 rank x 8 or 4 ranks x 2.
    reference = _global_batches(_loaders(data_dir, kind, 1, 8), 30)
    two = _loaders(data_dir, kind, 2, 4)
    assert [torch.equal(a, b) for a, b in zip(_global_batches(two, 10), reference[:10])] == [True] * 10
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    for world, mb in ((1, 8), (4, 2)):
        resumed = _loaders(data_dir, kind, world, mb)
        for loader in resumed:
            loader.load_state_dict(state)
        got = _global_batches(resumed, 20)
        assert all(torch.equal(a, b) for a, b in zip(got, reference[10:])), f"{world} ranks"


def test_ranks_read_disjoint_samples_within_an_epoch(data_dir):
    ranks = _loaders(data_dir, "prepared", 2, 4)
    steps = ranks[0].num_samples // 8  # one epoch of global batches
    seen = [tuple(row.tolist()) for _ in range(steps) for loader in ranks for row in next(loader)[0]]
    assert len(seen) == steps * 8 and len(set(seen)) == len(seen)


def test_stream_ranks_split_the_documents_and_shuffle(data_dir):
    spec = _spec(data_dir, "stream", 0)
    cfg = DataConfig(dataset=spec["dataset"], tokenizer=spec["tokenizer"], streaming=True, shuffle_buffer=8,
                     num_workers=0)
    tok = build_tokenizer(cfg, 512)
    from ember.data.stream import open_stream

    texts = [[row["text"] for row in open_stream(cfg, "train", r, 2)[0]] for r in range(2)]
    assert len(texts[0]) + len(texts[1]) == 30 and not set(texts[0]) & set(texts[1])
    loader = build_loader(cfg, tok, seq_len=16, micro_batch_size=4, vocab_size=512)
    rows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in (next(loader) for _ in range(3))]  # (4, 17): whole rows
    streamed = tok.decode(torch.cat(rows).flatten())
    in_order = "".join(t + "<|end_of_text|>" for t in texts[0] + texts[1])
    assert streamed[:200] != in_order[:200]  # the buffer reorders documents
    assert streamed.split("<|end_of_text|>")[1] in texts[0] + texts[1]  # but keeps them whole


def test_stream_refuses_a_missing_text_field_at_start(tmp_path, data_dir):
    path = tmp_path / "other.jsonl"
    path.write_text('{"body": "no text field here"}\n' * 5)
    cfg = DataConfig(dataset=str(path), tokenizer=str(data_dir / "tok" / "tokenizer.json"), streaming=True)
    with pytest.raises(ValueError, match=r"other\.jsonl has no 'text' field \(it has: body\); set data.text_field"):
        build_loader(cfg, build_tokenizer(cfg, 512), seq_len=16, micro_batch_size=4)


def test_streamed_files_have_no_held_out_split_and_say_what_to_do(data_dir):
    """Without data.val_split: no validation, said with the fix; naming one (a hub dataset's) is refused."""
    from ember.data.stream import open_stream
    from ember.errors import ConfigError, DataError

    spec = _spec(data_dir, "stream", 0)
    cfg = DataConfig(dataset=spec["dataset"], tokenizer=spec["tokenizer"], streaming=True, num_workers=0)
    with pytest.raises(DataError, match=r"streamed files have no held-out split \(data.streaming=false holds out "):
        open_stream(cfg, "val", 0, 1)
    with pytest.raises(ConfigError, match="data.val_split=validation names a split of a hub dataset; streamed files "
                                          "have none: drop it"):
        open_stream(dataclasses.replace(cfg, val_split="validation"), "val", 0, 1)
