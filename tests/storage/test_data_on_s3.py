"""Data and tokenizers on an S3-compatible server (moto on 127.0.0.1): data.dataset as a file, a folder or a glob
URL, data.tokenizer as a URL, and eval's task and ppl data, each read through its local copy and equal to reading
the same files locally. A source that is not there is one line before any work."""

import json
from pathlib import Path

import pytest

from ember.data.tokenizer import embedded_tokenizer
from tests.helpers import job_env, losses_by_step, run_ember, tiny_model
from tests.object_store import BUCKET

pytestmark = pytest.mark.slow

RUN = ["debug", *tiny_model(), "seq_len=32", "global_batch_size=2", "micro_batch_size=2", "max_steps=4",
       "logging_steps=1", "eval_batches=1", "metrics.console=false", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, s3_server):
    """Two jsonl files and a tokenizer.json, locally and under s3://BUCKET/data/ and s3://BUCKET/tok/."""
    local = tmp_path_factory.mktemp("sources")
    (local / "data").mkdir()
    for part in range(2):
        rows = [{"text": f"document {part}-{i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40))}
                for i in range(60)]
        (local / "data" / f"part-{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (local / "tok").mkdir()
    embedded_tokenizer(8192, 0.02).tok.save(str(local / "tok" / "tokenizer.json"))
    fs = s3_server.filesystem()
    fs.put(str(local / "data"), f"{BUCKET}/data", recursive=True)
    fs.put(str(local / "tok"), f"{BUCKET}/tok", recursive=True)
    return local


def _env(s3_server, tmp_path: Path) -> dict:
    return job_env(**s3_server.env(EMBER_CACHE=str(tmp_path / "cache")))


@pytest.mark.parametrize("local_spec, url_suffix", [("data/part-0.jsonl", "data/part-0.jsonl"),
                                                    ("data", "data"), ("data/*.jsonl", "data/*.jsonl")])
def test_training_data_and_tokenizer_from_urls_equal_the_local_files(sources, s3_server, tmp_path, local_spec,
                                                                      url_suffix):
    env = _env(s3_server, tmp_path)
    base = f"s3://{BUCKET}"
    run_ember("train", *RUN, f"data.dataset={sources / local_spec}", f"data.tokenizer={sources / 'tok'}",
              f"output_dir={tmp_path / 'local'}", env=env, expect=0)
    run_ember("train", *RUN, f"data.dataset={base}/{url_suffix}", f"data.tokenizer={base}/tok/tokenizer.json",
              f"output_dir={tmp_path / 'remote'}", env=env, expect=0)
    assert losses_by_step(tmp_path / "remote") == losses_by_step(tmp_path / "local")
    assert len(losses_by_step(tmp_path / "local")) == 4
    recorded = (tmp_path / "remote" / "config.yaml").read_text()
    assert f"dataset: {base}/{url_suffix}" in recorded  # the run's config keeps the URL


def test_eval_reads_ppl_and_task_data_from_urls(sources, s3_server, tmp_path):
    env = _env(s3_server, tmp_path)
    rows = [{"text": f"the answer is word{i}"} for i in range(5)]
    (sources / "lambada.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s3_server.filesystem().put(str(sources / "lambada.jsonl"), f"{BUCKET}/tasks/lambada.jsonl")
    run = tmp_path / "run"
    run_ember("train", *RUN, f"data.dataset={sources / 'data'}", f"data.tokenizer={sources / 'tok'}",
              f"output_dir={run}", env=env, expect=0)
    scores = {}
    for where, ppl, lambada in (("local", sources / "data", sources / "lambada.jsonl"),
                                ("remote", f"s3://{BUCKET}/data", f"s3://{BUCKET}/tasks/lambada.jsonl")):
        out = tmp_path / f"eval-{where}.json"
        run_ember("eval", str(run), f"ppl={ppl}", f"lambada={lambada}", "--output", str(out), env=env, expect=0)
        scores[where] = json.loads(out.read_text())["results"]
    local, remote = scores["local"], scores["remote"]
    for task in ("ppl", "lambada"):
        numbers = {k: v for k, v in local[task].items() if isinstance(v, (int, float))}
        assert numbers and numbers == {k: remote[task][k] for k in numbers}
    assert remote["ppl"]["data"] == f"s3://{BUCKET}/data"  # eval.json names the data as the user gave it


def test_a_missing_data_url_is_one_line_before_any_work(sources, s3_server, tmp_path):
    env = _env(s3_server, tmp_path)
    for key, value in (("data.dataset", f"s3://{BUCKET}/nothing/here.jsonl"),
                       ("data.tokenizer", f"s3://{BUCKET}/tok/missing.json"),
                       ("data.dataset", "s3://no-such-bucket/data.jsonl")):
        extra = [] if key == "data.tokenizer" else [f"data.tokenizer={sources / 'tok'}"]
        proc = run_ember("train", *RUN, f"{key}={value}", *extra, f"output_dir={tmp_path / 'run'}", env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1 and key in proc.stderr, proc.stderr
        assert not (tmp_path / "run").exists()


def test_a_corpus_larger_than_the_cache_streams_from_the_store(sources, s3_server, tmp_path):
    """The cache's bound below the corpus: copying it is refused in one line that names data.streaming=true;
    streamed, the objects are read from the store (none lands in the cache), the losses equal streaming the same
    files from disk, and a resume continues the stream exactly."""
    env = dict(_env(s3_server, tmp_path), EMBER_REMOTE_CACHE_GB="0.00001")  # ~10 KiB, the two files ~30 KiB
    data = [f"data.dataset=s3://{BUCKET}/data", f"data.tokenizer={sources / 'tok'}"]
    copied = run_ember("train", *RUN, *data, f"output_dir={tmp_path / 'copied'}", env=env)
    assert copied.returncode == 2 and copied.stderr.count("\n") == 1, copied.stderr
    assert "more than the local cache's bound of 10.5 KiB (EMBER_REMOTE_CACHE_GB=0.00001)" in copied.stderr
    assert copied.stderr.rstrip().endswith("or read it as it trains: data.streaming=true")
    stream = ["data.streaming=true", "data.val_split=null", "data.shuffle_buffer=8"]
    run_ember("train", *RUN, *data, *stream, f"output_dir={tmp_path / 'remote'}", env=env, expect=0)
    run_ember("train", *RUN, *stream, f"data.dataset={sources / 'data'}", f"data.tokenizer={sources / 'tok'}",
              f"output_dir={tmp_path / 'local'}", env=env, expect=0)
    assert losses_by_step(tmp_path / "remote") == losses_by_step(tmp_path / "local")
    assert len(losses_by_step(tmp_path / "remote")) == 4
    assert not list((tmp_path / "cache").rglob("*.jsonl"))
    resumed = tmp_path / "resumed"
    for steps in (2, 4):
        run_ember("train", *[a for a in RUN if not a.startswith("max_steps=")], *data, *stream, f"max_steps={steps}",
                  "checkpoint.interval=2", f"output_dir={resumed}", env=env, expect=0)
    assert losses_by_step(resumed) == losses_by_step(tmp_path / "remote")
