"""Document sources: the embedded corpus and its split, local files, and the one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_testing import CORPUS_FILES, LATIN1_FILE, DataCfg

from ember.data import sources
from ember.data.sources import load_documents


def test_embedded_files_sorted_without_installed_packages(small_corpus: Path):
    files = sources.embedded_files()
    assert files == sorted(CORPUS_FILES + [LATIN1_FILE])
    assert not any("site-packages" in f for f in files)


def test_real_stdlib_listing_is_large_and_clean():
    # Only lists and stats files (no reading): tens of milliseconds.
    files = sources.embedded_files()
    assert len(files) > 500 and "os.py" in files and "json/decoder.py" in files
    assert not any("site-packages" in f or "dist-packages" in f for f in files)


def test_split_is_deterministic_disjoint_and_complete():
    keys = [f"pkg/module_{i}.py" for i in range(1000)]
    split = sources.split_keys(keys, 0.05)
    assert split == sources.split_keys(keys, 0.05)
    # Membership depends on the key only, not on the order or the company it comes in.
    assert set(sources.split_keys(list(reversed(keys)), 0.05)["val"]) == set(split["val"])
    assert set(split["val"]) & set(keys[:500]) == set(sources.split_keys(keys[:500], 0.05)["val"])
    assert set(split["train"]).isdisjoint(split["val"]) and len(split["train"]) + len(split["val"]) == 1000
    assert 20 < len(split["val"]) < 80  # ~5%
    assert sources.split_keys(keys, 0.0)["val"] == []
    # A tiny corpus still holds one document out.
    assert len(sources.split_keys(keys[:3], 0.02)["val"]) == 1
    with pytest.raises(ValueError, match=r"data\.val_fraction"):
        sources.split_keys(keys, 1.5)


def test_embedded_documents_skip_and_count_non_utf8(small_corpus: Path):
    train = load_documents(DataCfg(), "train")
    val = load_documents(DataCfg(), "val")
    assert train.skipped == [LATIN1_FILE] and val.skipped == []
    assert len(train.texts) + len(val.texts) == len(CORPUS_FILES)
    assert len(val.texts) == 1
    assert "embedded corpus" in train.name


def test_fingerprint_follows_the_corpus(small_corpus: Path):
    before = sources.embedded_fingerprint()
    assert sources.embedded_fingerprint() == before
    (small_corpus / "new_module.py").write_text("print('hello')\n")
    assert sources.embedded_fingerprint() != before


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_local_txt_jsonl_json_and_glob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha document")
    _write_jsonl(folder / "sub" / "b.jsonl", [{"text": f"row {i}", "id": i} for i in range(20)])
    (folder / "c.json").write_text(json.dumps([{"text": "json item"}]))
    (folder / "notes.md").write_text("not a data file: ignored in a folder")
    cfg = DataCfg(dataset=str(folder), val_fraction=0.1)
    train, val = load_documents(cfg, "train"), load_documents(cfg, "val")
    assert sorted(train.texts + val.texts) == sorted(["alpha document", "json item"] + [f"row {i}" for i in range(20)])
    assert val.texts and set(train.texts).isdisjoint(val.texts)
    # The split depends on paths inside the folder, not on how the folder is named.
    monkeypatch.chdir(tmp_path)
    again = load_documents(DataCfg(dataset="data/", val_fraction=0.1), "val")
    assert again.texts == val.texts
    only_jsonl = load_documents(DataCfg(dataset=str(folder / "**" / "*.jsonl"), val_fraction=0.0), "train")
    assert only_jsonl.texts == [f"row {i}" for i in range(20)]


def test_local_non_utf8_file_is_skipped_and_counted(tmp_path: Path):
    (tmp_path / "good.txt").write_text("fine text")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    docs = load_documents(DataCfg(dataset=str(tmp_path), val_fraction=0.0), "train")
    assert docs.texts == ["fine text"] and docs.skipped == [str(tmp_path / "bad.txt")]
    (tmp_path / "good.txt").unlink()
    with pytest.raises(ValueError, match=r"yields no documents: 1 of its files are not UTF-8 text"):
        load_documents(DataCfg(dataset=str(tmp_path)), "train")


def test_missing_path(tmp_path: Path):
    for spec in (str(tmp_path / "nope.jsonl"), "./data/missing", "some/deep/folder", "missing/"):
        with pytest.raises(FileNotFoundError, match=rf"data\.dataset path '{spec}' does not exist"):
            load_documents(DataCfg(dataset=spec), "train")
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        load_documents(DataCfg(dataset=str(tmp_path / "*.txt")), "train")


def test_empty_file_and_empty_folder(tmp_path: Path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"data\.dataset '{empty}' yields no documents: it is empty"):
        load_documents(DataCfg(dataset=str(empty)), "train")
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError,
                       match=rf"data\.dataset folder '{folder}' holds no \.txt/\.jsonl/\.json/\.parquet/\.arrow files"):
        load_documents(DataCfg(dataset=str(folder)), "train")
    csv = tmp_path / "table.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"is not one of \.txt/\.jsonl/\.json/\.parquet/\.arrow"):
        load_documents(DataCfg(dataset=str(csv)), "train")


def test_single_document_has_no_val_split(tmp_path: Path):
    one = tmp_path / "one.txt"
    one.write_text("only document")
    assert load_documents(DataCfg(dataset=str(one)), "train").texts == ["only document"]
    with pytest.raises(ValueError, match=r"too few to hold one out for the val split"):
        load_documents(DataCfg(dataset=str(one)), "val")
    with pytest.raises(ValueError, match=rf"^data\.val_fraction=0 holds no documents of data\.dataset '{one}' out for "
                                         r"a val split$"):
        load_documents(DataCfg(dataset=str(one), val_fraction=0.0), "val")


def test_jsonl_without_the_text_field(tmp_path: Path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"text": "ok"}, {"content": "no text key", "id": 2}])
    with pytest.raises(ValueError) as err:
        load_documents(DataCfg(dataset=str(path)), "train")
    message = str(err.value)
    assert f"{path} line 2 has no 'text' field (it has: content, id); set data.text_field" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"line 1 has no 'content' field \(it has: text\)"):
        load_documents(DataCfg(dataset=str(path), text_field="content"), "train")
    (tmp_path / "rows.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match=r"rows\.jsonl line 2 is not valid JSON"):
        load_documents(DataCfg(dataset=str(path)), "train")


def test_hub_and_parquet_need_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # `datasets` is a dependency, so its absence is simulated: a None entry in sys.modules makes
    # `import datasets` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.chdir(tmp_path)  # so "owner/name" is not accidentally a local folder
    with pytest.raises(ValueError, match=r"'owner/corpus' is not a local file, folder or glob.*pip install datasets"):
        load_documents(DataCfg(dataset="owner/corpus"), "train")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError,
                       match=r"reading '.*t\.parquet' needs the `datasets` library; run `pip install datasets`"):
        load_documents(DataCfg(dataset=str(tmp_path / "t.parquet")), "train")


def test_local_text_does_not_import_datasets(tmp_path: Path):
    # `datasets` is imported lazily, only when a source needs it (it is slow to import).
    (tmp_path / "a.txt").write_text("hello world\n")
    code = ("import sys; from ember.data.sources import load_documents; from data_testing import DataCfg; "
            f"load_documents(DataCfg(dataset={str(tmp_path / 'a.txt')!r}, val_fraction=0.0), 'train'); "
            "assert 'datasets' not in sys.modules, 'datasets was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_reading_parquet_prints_no_progress_bars(tmp_path: Path, capfd: pytest.CaptureFixture):
    # `datasets` draws progress bars and info logs by default; they would break into ember's console.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document number {i}" for i in range(50)]}), tmp_path / "t.parquet")
    capfd.readouterr()
    docs = load_documents(DataCfg(dataset=str(tmp_path / "t.parquet"), val_fraction=0.0), "train")
    assert len(docs.texts) == 50
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
