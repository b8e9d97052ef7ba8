"""The storage layer on fsspec's in-memory filesystem: locations, the run mirror, the bounded local cache."""

import glob
from pathlib import Path

import fsspec
import pytest

from ember.config_schema import DataConfig
from ember.errors import ConfigError, UserFileNotFound
from ember.storage import cache, location
from ember.storage.mirror import RunMirror, local_run_dir


@pytest.fixture
def memory(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    return fs


def test_locations():
    assert location.as_path("~/run") == Path.home() / "run"
    assert location.as_path("file:///tmp/run") == Path("/tmp/run")
    remote = location.as_path("memory://bucket/run")
    assert not isinstance(remote, Path) and str(remote / "checkpoints") == "memory://bucket/run/checkpoints"
    assert location.is_url("s3://b/x") and not location.is_url("file:///x") and not location.is_url("runs/x")
    assert location.canonical("s3://b/x/") == "s3://b/x"


def test_credentials_in_a_url_are_refused_and_never_echoed():
    secret = "abc/def+ghi"  # a '/' in the secret cuts urlsplit's host part short
    with pytest.raises(ConfigError, match="carries credentials in the URL") as err:
        location.check_url(f"s3://AKID:{secret}@bucket/run", "output_dir")
    assert secret not in str(err.value) and "AKID" not in str(err.value)
    location.check_url("s3://bucket/run@2", "output_dir")  # an '@' in a key is no credential


def test_a_scheme_without_its_backend_names_the_package():
    with pytest.raises(ConfigError, match="pip install gcsfs"):
        location.check_url("gs://bucket/run", "output_dir")
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        location.check_url("nosuchscheme://bucket/run", "output_dir")


def test_a_data_url_carrying_credentials_is_refused():
    from ember.config import load

    cfg = load("debug", ["data.dataset=s3://AKIAEXAMPLE:secret@bucket/data.jsonl"])
    with pytest.raises(ConfigError, match="data.dataset") as err:
        location.check_locations(cfg)
    assert "secret" not in str(err.value)


def test_the_mirror_pulls_all_but_checkpoints_and_pushes_what_changed(memory, tmp_path):
    memory.pipe({"/b/run/metrics.jsonl": b"1\n", "/b/run/config.yaml": b"a: 1\n",
                 "/b/run/checkpoints/step-2/model.json": b"{}", "/b/run/previous-1/checkpoints/step-2/x": b"x",
                 "/b/run/previous-1/metrics.jsonl": b"0\n"})
    local = local_run_dir("memory://b/run")
    assert local.is_relative_to(tmp_path / "cache") and local_run_dir("runs/x") == Path("runs/x")
    mirror = RunMirror(location.as_path("memory://b/run"), local)
    mirror.pull()
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        "config.yaml", "metrics.jsonl", "previous-1/metrics.jsonl"]
    (local / "metrics.jsonl").write_text("1\n2\n")
    (local / "config.yaml").unlink()
    (local / "tb").mkdir()
    (local / "tb" / "events").write_bytes(b"e")
    mirror.push()
    assert memory.cat("/b/run/metrics.jsonl") == b"1\n2\n" and memory.cat("/b/run/tb/events") == b"e"
    assert not memory.exists("/b/run/config.yaml")  # moved away locally: gone from the store
    assert memory.exists("/b/run/checkpoints/step-2/model.json")  # never touched by the mirror
    memory.pipe("/b/run/tb/events", b"changed on the store")
    mirror.push()  # nothing changed locally: nothing uploaded
    assert memory.cat("/b/run/tb/events") == b"changed on the store"


def test_the_cache_downloads_once_reuses_and_notices_a_change(memory, tmp_path):
    memory.pipe({"/b/model/config.json": b"{}", "/b/model/model.safetensors": b"w" * 100})
    copy = cache.local_copy("memory://b/model")
    assert copy.name == "model" and (copy / "model.safetensors").read_bytes() == b"w" * 100
    stamp = (copy / "config.json").stat().st_mtime_ns
    assert cache.local_copy("memory://b/model/") == copy and (copy / "config.json").stat().st_mtime_ns == stamp
    memory.pipe("/b/model/model.safetensors", b"v" * 120)  # changed on the store: downloaded again
    assert (cache.local_copy("memory://b/model") / "model.safetensors").read_bytes() == b"v" * 120
    memory.pipe("/b/tokenizer.json", b"{}")
    assert cache.local_copy("memory://b/tokenizer.json").read_bytes() == b"{}"
    with pytest.raises(UserFileNotFound, match="does not exist"):
        cache.local_copy("memory://b/nothing-here", "model.init_from")
    assert cache.local_copy(str(tmp_path)) == tmp_path  # a local path is itself


def test_the_cache_is_bounded(memory, monkeypatch):
    memory.pipe({"/b/a/w": b"a" * 600, "/b/b/w": b"b" * 600, "/b/big/w": b"c" * 2000})
    monkeypatch.setenv("EMBER_REMOTE_CACHE_GB", str(1000 / 2**30))  # 1000 bytes
    first = cache.local_copy("memory://b/a")
    second = cache.local_copy("memory://b/b")  # a's 600 + b's 600 > 1000: the least recently used goes
    assert second.is_dir() and not first.exists()
    with pytest.raises(ConfigError, match="more than the local cache's bound of 1000 bytes"):
        cache.local_copy("memory://b/big")
    assert second.is_dir()  # a refused copy removes nothing


def test_a_run_is_copied_as_a_run_its_newest_committed_checkpoint_and_config(memory):
    memory.pipe({"/b/run/config.yaml": b"data: {}\n", "/b/run/metrics.jsonl": b"{}\n",
                 "/b/run/checkpoints/step-2/model.json": b"{}", "/b/run/checkpoints/step-2/a.distcp": b"2",
                 "/b/run/checkpoints/step-4/model.json": b"{}", "/b/run/checkpoints/step-4/a.distcp": b"4",
                 "/b/run/checkpoints/step-4/eval.json": b"{}", "/b/run/checkpoints/step-6/a.distcp": b"6"})
    copy = cache.local_copy("memory://b/run")
    assert copy.name == "run" and sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == [
        "checkpoints/step-4/a.distcp", "checkpoints/step-4/model.json", "config.yaml"]
    stamp = (copy / "checkpoints/step-4/a.distcp").stat().st_mtime_ns
    memory.pipe("/b/run/checkpoints/step-4/eval.json", b'{"results": {}}')  # eval's results: the copy stays
    assert cache.local_copy("memory://b/run") == copy
    assert (copy / "checkpoints/step-4/a.distcp").stat().st_mtime_ns == stamp
    step = cache.local_copy("memory://b/run/checkpoints/step-2")  # a checkpoint: with its run's config beside it
    assert step.name == "step-2" and (step / "a.distcp").read_bytes() == b"2"
    assert (step.parent.parent / "config.yaml").read_bytes() == b"data: {}\n"


def test_a_directory_is_uploaded_whole_or_not_at_all(memory, tmp_path, monkeypatch):
    from ember.storage.staging import staged_at

    memory.pipe({"/b/out/config.json": b"old", "/b/out/old.safetensors": b"old"})
    dst = location.as_path("memory://b/out")
    put_file = type(memory).put_file
    calls = []

    def failing(self, lpath, rpath, **kwargs):
        calls.append(rpath)
        if len(calls) == 2:
            raise OSError("connection reset")
        return put_file(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(type(memory), "put_file", failing)
    with pytest.raises(OSError, match="connection reset"):
        with staged_at(dst, "convert", directory=True, markers=("config.json",)) as stage:
            for name in ("a.safetensors", "b.safetensors", "config.json"):
                (stage / name).write_text("new")
    assert sorted(memory.find("/b")) == ["/b/out/config.json", "/b/out/old.safetensors"]  # as it was
    monkeypatch.setattr(type(memory), "put_file", put_file)
    with staged_at(dst, "convert", directory=True, markers=("config.json",)) as stage:
        for name in ("a.safetensors", "config.json"):
            (stage / name).write_text("new")
    assert sorted(memory.find("/b")) == ["/b/out/a.safetensors", "/b/out/config.json"]
    assert memory.cat("/b/out/config.json") == b"new"
    assert not any((tmp_path / "cache" / "uploads").iterdir())  # the local stage removed


def test_data_on_a_store_is_checked_and_read_from_its_local_copy(tmp_path, monkeypatch):
    """A data or task source given as a URL: there before any work (a missing one named in one line), then read
    from its local copy; a glob is matched in the copy of its prefix."""
    from ember.data.sources import check_source_exists
    from ember.eval.tasks import read_rows
    from ember.storage.cache import local_data

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    memory.pipe("/data/a.jsonl", b'{"text": "one"}\n')
    memory.pipe("/data/b.jsonl", b'{"text": "two"}\n')
    check_source_exists("memory://data/a.jsonl", "data.dataset")
    check_source_exists("memory://data/*.jsonl", "data.dataset")
    with pytest.raises(UserFileNotFound, match="ppl memory://data/missing.jsonl does not exist"):
        check_source_exists("memory://data/missing.jsonl", "ppl")
    local = local_data(DataConfig(dataset="memory://data/*.jsonl"))
    assert sorted(Path(p).read_text() for p in glob.glob(local.dataset)) == ['{"text": "one"}\n', '{"text": "two"}\n']
    assert read_rows("memory://data/a.jsonl", "lambada", ("text",)) == [{"text": "one"}]
