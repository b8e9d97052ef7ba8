"""Bad data, one case at a time: handled (and reported) or refused at start with the file and the fix."""

from pathlib import Path

import datasets
import pytest
import torch
from data_testing import DataCfg

from ember.data import packing, prepare
from ember.data.loader import build_loader
from ember.data.tokenizer import Tokenizer


def test_a_document_longer_than_seq_len_spans_consecutive_samples(tmp_path: Path, small_tokenizer: Tokenizer):
    folder = tmp_path / "docs"
    folder.mkdir()
    long_text = " ".join(f"word{i}" for i in range(400))
    (folder / "long.txt").write_text(long_text)
    (folder / "short.txt").write_text("tiny " * 40)  # after it: the dropped tail of the stream is not the long one
    cfg = DataCfg(dataset=str(folder), val_fraction=0.0, num_workers=0)
    stream = prepare.token_stream(cfg, small_tokenizer, "train")
    rows = packing.pack(stream.tokens, 16)
    assert len(rows) > 10  # the long document fills many samples: nothing is cut off or dropped but the tail
    joined = torch.from_numpy(rows.reshape(-1).astype("int64"))
    assert long_text in small_tokenizer.decode(joined)


def test_a_folder_with_empty_and_non_utf8_files_trains_on_the_rest(tmp_path: Path, small_tokenizer: Tokenizer):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "empty.txt").write_text("")
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (folder / "empty.jsonl").write_text("\n\n")
    for i in range(20):
        (folder / f"good{i}.txt").write_text(f"good text number {i} " * 20)
    cfg = DataCfg(dataset=str(folder), val_fraction=0.0, num_workers=0)
    loader = build_loader(cfg, small_tokenizer, seq_len=16, micro_batch_size=2)
    assert next(loader)[0].shape == (2, 16)
    assert loader.skipped == [str(folder / "latin1.txt")]  # skipped, and said so in the run's header line
    assert "1 file(s) skipped as not UTF-8" in loader.describe()
    assert prepare.token_stream(cfg, small_tokenizer, "train").num_documents == 20  # the empty ones add nothing


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_table_files_through_datasets(tmp_path: Path, small_tokenizer: Tokenizer, fmt: str):
    table = datasets.Dataset.from_dict({"content": [f"row {i} " * 10 for i in range(50)], "id": list(range(50))})
    if fmt == "parquet":
        path = tmp_path / "data.parquet"
        table.to_parquet(str(path))
    else:
        table.save_to_disk(str(tmp_path / "saved"))
        (path,) = (tmp_path / "saved").glob("*.arrow")
    stream = prepare.token_stream(DataCfg(dataset=str(path), text_field="content"), small_tokenizer, "train")
    assert stream.num_documents >= 45
    with pytest.raises(ValueError,
                       match=rf"{path.name} has no 'text' column \(it has: content, id\); set data\.text_field"):
        prepare.token_stream(DataCfg(dataset=str(path)), small_tokenizer, "train")
    broken = tmp_path / f"broken.{fmt}"
    broken.write_bytes(b"not a table at all")
    with pytest.raises(ValueError, match=rf"broken\.{fmt} is not a readable {fmt} file"):
        prepare.token_stream(DataCfg(dataset=str(broken)), small_tokenizer, "train")
