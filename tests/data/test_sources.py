"""The download task against real sources: local formats, HTTP on 127.0.0.1 (with a server
that fails first), S3 (moto_server through s3fs), a Hugging Face dataset folder (offline)."""

import gzip
import json

import pytest

from stoker.config import DataConfig
from stoker.data import prepare as data_prep
from stoker.failures import DataError, SourceUnreachable, is_transient
from stoker.storage.store import Store
from tests.conftest import free_port


@pytest.fixture
def store(tmp_path):
    return Store("file://" + str(tmp_path / "store"))


def _records(n, field="text", tag="doc"):
    return "".join(json.dumps({field: f"{tag} {i}: " + "some words here " * 8, "n": i}) + "\n" for i in range(n))


def _corpus_docs(store, ds):
    return list(data_prep.iter_corpus(store, ds))


# ---- local files ---------------------------------------------------------------------
def test_local_formats_text_jsonl_gzip_and_parquet(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(_records(5, "body", "json"))
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.write(_records(4, "body", "gz"))
    pq.write_table(pa.table({"body": [f"parquet {i}" for i in range(3)], "n": [1, 2, 3]}), src / "c.parquet")
    (src / "d.txt").write_text("plain text paragraph\n\nanother one\n")
    (src / "ignored.bin").write_bytes(b"\x00\x01")  # a folder source takes data files only
    ds = data_prep.download_dataset(DataConfig(source=str(src), text_field="body"), store)
    docs = _corpus_docs(store, ds)
    assert ds.num_docs == len(docs) == 5 + 4 + 3 + 1
    assert docs[0].startswith("json 0") and docs[5].startswith("gz 0") and docs[9] == "parquet 0"
    assert docs[-1] == "plain text paragraph\n\nanother one\n"


def test_local_fingerprint_is_content_and_the_parameters_that_shape_documents(store, tmp_path):
    (tmp_path / "x.jsonl").write_text(_records(20))
    base = data_prep.download_dataset(DataConfig(source=str(tmp_path / "x.jsonl")), store)
    again = data_prep.download_dataset(DataConfig(source=str(tmp_path / "*.jsonl")), store)
    assert again.cache_hit and again.fingerprint == base.fingerprint
    capped = data_prep.download_dataset(DataConfig(source=str(tmp_path / "x.jsonl"), max_bytes=500), store)
    assert capped.fingerprint != base.fingerprint and 0 < capped.num_docs < base.num_docs
    (tmp_path / "x.jsonl").write_text(_records(21))
    changed = data_prep.download_dataset(DataConfig(source=str(tmp_path / "x.jsonl")), store)
    assert changed.fingerprint != base.fingerprint and not changed.cache_hit


def test_not_utf8_file_fails_or_is_skipped_and_counted(store, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-good.txt").write_text("good text\n\n" * 50)
    # valid UTF-8 for a while, then a bad byte: what was read of it must be rolled back
    (src / "b-bad.txt").write_bytes(("fine line\n\n" * 2000).encode() + b"\xff\xfe broken\n")
    (src / "c-good.jsonl").write_text(_records(3))
    with pytest.raises(DataError, match=r"data.source: .*b-bad.txt is not UTF-8.*on_decode_error='skip'"):
        data_prep.download_dataset(DataConfig(source=str(src)), store)
    assert not store.exists("datasets")
    ds = data_prep.download_dataset(DataConfig(source=str(src), on_decode_error="skip"), store)
    assert ds.num_skipped_files == 1
    docs = _corpus_docs(store, ds)
    assert not any("fine line" in d for d in docs) and docs[-1].startswith("doc 2")
    info = store.read_json(f"{ds.key}/info.json")
    assert info["num_skipped_files"] == 1 and info["skipped_files"][0].endswith("b-bad.txt")


def test_only_undecodable_files_is_an_empty_source_with_the_count(store, tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00garbage")
    cfg = DataConfig(source=str(tmp_path / "bad.txt"), on_decode_error="skip")
    with pytest.raises(DataError, match=r"no non-empty document \(1 file\(s\) skipped as not UTF-8\)"):
        data_prep.download_dataset(cfg, store)
    assert not store.exists("datasets")


def test_missing_parquet_column_and_bad_json_name_the_field(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "t.parquet")
    no_column = r"data.text_field: .*t.parquet has no column 'text' \(columns: \['content'\]\)"
    with pytest.raises(DataError, match=no_column):
        data_prep.download_dataset(DataConfig(source=str(tmp_path / "t.parquet")), store)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"data.source: .*broken.jsonl line 2 is not JSON"):
        data_prep.download_dataset(DataConfig(source=str(tmp_path / "broken.jsonl")), store)
    assert not store.exists("datasets")


def test_new_data_fields_are_checked_with_their_fix(tmp_path):
    from stoker.config import ConfigError, RunConfig, load_config, local_resource_problems

    with pytest.raises(ConfigError) as err:
        load_config(
            {
                "data": {
                    "source": str(tmp_path),
                    "storage_options": {"anon": True},
                    "hf_revision": "main",
                    "num_workers": 0,
                    "text_field": " ",
                }
            }
        )
    problems = "\n".join(err.value.problems)
    for expected in (
        "data.storage_options: only used with a URL source",
        "data.hf_revision: only applies to 'hf:' sources",
        "data.num_workers: must be 'auto' or a whole number between 1 and 256",
        "data.text_field: is empty",
    ):
        assert expected in problems
    # a missing local folder is this host's problem, not the model's
    [problem] = local_resource_problems(RunConfig(data=DataConfig(source="hf:/no/such/folder")))
    assert problem.startswith("data.source: no local dataset folder")
    s3 = DataConfig(source="s3://bucket/x/*.jsonl", storage_options={"anon": True})  # valid
    assert local_resource_problems(RunConfig(data=s3)) == []


# ---- HTTP ----------------------------------------------------------------------------
def test_http_source_retries_503s_then_reuses_the_download_by_etag(http_server, store, fast_retries, tmp_path):
    (tmp_path / "www" / "corpus.jsonl").write_text(_records(30))
    cfg = DataConfig(source=http_server.url("corpus.jsonl"))
    http_server.fail_first = 2  # the metadata request (HEAD, then GET fallback) fails once
    ds = data_prep.download_dataset(cfg, store)
    assert not ds.cache_hit and ds.num_docs == 30
    assert [r[2] for r in http_server.log[:2]] == [503, 503] and http_server.log[-1] == ("GET", "/corpus.jsonl", 200)
    info = store.read_json(f"{ds.key}/info.json")
    [[fmt, _, ident]] = info["fingerprint_inputs"]["items"]
    assert fmt == "jsonl" and ident["etag"] and ident["size"] == len((tmp_path / "www" / "corpus.jsonl").read_bytes())

    seen = len(http_server.log)
    again = data_prep.download_dataset(cfg, store)  # fingerprint from a HEAD: no download
    assert again.cache_hit and again.fingerprint == ds.fingerprint
    assert [r[0] for r in http_server.log[seen:]] == ["HEAD"]

    (tmp_path / "www" / "corpus.jsonl").write_text(_records(31))  # new content, new ETag
    http_server.fail_first, http_server.fail_method = 1, "GET"  # now the body download fails once
    changed = data_prep.download_dataset(cfg, store)
    assert changed.fingerprint != ds.fingerprint and changed.num_docs == 31
    assert [r[2] for r in http_server.requests("GET")][-2:] == [503, 200]


def test_http_without_etag_is_fingerprinted_by_content(http_server, store, tmp_path):
    (tmp_path / "www" / "c.jsonl").write_text(_records(10))
    (tmp_path / "c.jsonl").write_text(_records(10))
    http_server.etag = False
    remote = data_prep.download_dataset(DataConfig(source=http_server.url("c.jsonl")), store)
    local = data_prep.download_dataset(DataConfig(source=str(tmp_path / "c.jsonl")), store)
    assert local.fingerprint == remote.fingerprint and local.cache_hit


def test_http_404_is_a_data_error_and_not_retried(http_server, store, fast_retries):
    with pytest.raises(DataError, match=r"data.source: .*missing.jsonl does not exist \(HTTP 404"):
        data_prep.download_dataset(DataConfig(source=http_server.url("missing.jsonl")), store)
    assert len(http_server.log) <= 2  # one metadata call (HEAD, GET fallback), no retry
    assert not store.exists("datasets")


def test_unreachable_url_after_retries_is_a_clear_transient_error(http_server, store, fast_retries, tmp_path):
    (tmp_path / "www" / "c.txt").write_text("text")
    http_server.fail_first = 10**6
    unreachable = r"data.source: .*c.txt is unreachable after 5 attempts .*HTTP 503"
    with pytest.raises(SourceUnreachable, match=unreachable) as err:
        data_prep.download_dataset(DataConfig(source=http_server.url("c.txt")), store)
    assert is_transient(err.value)  # the Prefect task retries it later
    assert not store.exists("datasets")
    closed = f"http://127.0.0.1:{free_port()}/c.txt"  # nothing listens: connection refused, retried
    with pytest.raises(SourceUnreachable, match=r"unreachable after 5 attempts .*ConnectionRefusedError"):
        data_prep.download_dataset(DataConfig(source=closed), store)


# ---- S3 --------------------------------------------------------------------------------
def test_s3_source_is_fingerprinted_by_etag_and_listed_fresh(s3_root, fast_retries):
    import s3fs

    root, options = s3_root
    bucket = root.split("/")[2]
    fs = s3fs.S3FileSystem(**options)
    fs.pipe_file(f"{bucket}/src/a.jsonl", _records(12, "body").encode())
    fs.pipe_file(f"{bucket}/src/b.txt", b"plain text from s3\n")
    fs.pipe_file(f"{bucket}/src/skip.bin", b"\x00")
    store = Store(root, options)  # the store is on S3 too
    cfg = DataConfig(source=f"s3://{bucket}/src/", storage_options=options, text_field="body")
    ds = data_prep.download_dataset(cfg, store)
    assert ds.num_docs == 13 and not ds.cache_hit
    items = store.read_json(f"{ds.key}/info.json")["fingerprint_inputs"]["items"]
    assert [i[0] for i in items] == ["jsonl", "text"] and all(i[2]["etag"] for i in items)
    assert data_prep.download_dataset(cfg, store).cache_hit

    fs.pipe_file(f"{bucket}/src/a.jsonl", _records(11, "body").encode())
    changed = data_prep.download_dataset(cfg, store)
    assert changed.fingerprint != ds.fingerprint and changed.num_docs == 12
    only = data_prep.download_dataset(cfg.model_copy(update={"source": f"s3://{bucket}/src/*.jsonl"}), store)
    assert only.num_docs == 11
    with pytest.raises(DataError, match="does not exist"):
        data_prep.download_dataset(cfg.model_copy(update={"source": f"s3://{bucket}/nope.jsonl"}), store)


# ---- Hugging Face ------------------------------------------------------------------------
@pytest.fixture
def hf_offline(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)


def test_hf_dataset_through_load_dataset_on_a_local_folder(store, tmp_path, hf_offline):
    import datasets

    folder = tmp_path / "hfds"
    (folder / "data").mkdir(parents=True)
    train = datasets.Dataset.from_dict({"content": [f"train doc {i}" for i in range(40)], "id": list(range(40))})
    train.to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"content": ["val doc"], "id": [0]}).to_parquet(
        str(folder / "data" / "validation-00000-of-00001.parquet")
    )
    cfg = DataConfig(source=f"hf:{folder}", text_field="content")
    ds = data_prep.download_dataset(cfg, store)
    assert ds.num_docs == 40 and _corpus_docs(store, ds)[:2] == ["train doc 0", "train doc 1"]
    assert data_prep.download_dataset(cfg, store).cache_hit
    val = data_prep.download_dataset(cfg.model_copy(update={"hf_split": "validation"}), store)
    assert val.num_docs == 1 and val.fingerprint != ds.fingerprint

    with pytest.raises(DataError, match=r"data.hf_split: .*Bad split: test"):
        data_prep.download_dataset(cfg.model_copy(update={"hf_split": "test"}), store)
    with pytest.raises(DataError, match=r"data.text_field: .*no column 'text' \(columns: \['content', 'id'\]\)"):
        data_prep.download_dataset(cfg.model_copy(update={"text_field": "text"}), store)
    with pytest.raises(DataError, match=r"data.hf_revision: the Hub is offline"):
        data_prep.download_dataset(DataConfig(source="hf:someone/some-dataset"), store)

    saved = tmp_path / "saved"
    train.save_to_disk(str(saved))  # load_dataset refuses these folders; load_from_disk reads them
    from_disk = data_prep.download_dataset(cfg.model_copy(update={"source": f"hf:{saved}"}), store)
    assert from_disk.num_docs == 40


# ---- a folder read ahead by worker processes -----------------------------------------------
def _mixed_folder(folder):
    """Files of every local format, a file that is not UTF-8 and small files packed together."""
    folder.mkdir()
    for k in range(6):
        (folder / f"{k:02d}-part.jsonl").write_text(_records(40 + k, tag=f"f{k}"))
    (folder / "06-notes.txt").write_text("plain text, first document\n\n" + "more prose here. " * 300)
    (folder / "07-packed.jsonl.gz").write_bytes(gzip.compress(_records(25, tag="gz").encode()))
    (folder / "08-broken.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    (folder / "09-tail.jsonl").write_text(_records(3, tag="tail"))
    return folder


@pytest.mark.parametrize("max_bytes", [0, 12_000], ids=["whole", "capped"])
def test_a_folder_read_ahead_by_worker_processes_is_the_same_dataset(tmp_path, monkeypatch, max_bytes):
    """data.num_workers processes normalize whole files ahead of the writer (sources.file_lines
    through units.stream_units): the same parts, the same fingerprint and counts as one reader,
    with a file that is not UTF-8 skipped and counted, small files packed, and a cap cut at the
    same document; the read-ahead's files are gone after."""
    from stoker.data import sources, units
    from stoker.storage.datasets import dataset_parts

    monkeypatch.setattr(data_prep, "PARTITION_BYTES", 6_000)
    monkeypatch.setattr(sources, "READ_AHEAD_BYTES", 0)
    streamed = []
    real = units.stream_units
    monkeypatch.setattr(units, "stream_units", lambda u, *a, **k: streamed.append(len(u)) or real(u, *a, **k))
    src = _mixed_folder(tmp_path / "src")
    got = {}
    for workers in (1, 2):
        store = Store(f"file://{tmp_path}/store-{workers}")
        cfg = DataConfig(source=str(src), num_workers=workers, on_decode_error="skip", max_bytes=max_bytes)
        ds = data_prep.download_dataset(cfg, store)
        info = store.read_json(f"{ds.key}/info.json")
        parts = [(p.sha256, p.size, p.num_docs) for p in dataset_parts(store, ds.fingerprint)]
        got[workers] = (ds.fingerprint, ds.num_docs, parts, info["skipped_files"], info["capped_at"], info["num_bytes"])
    assert streamed == [10]  # one unit a file, on the second download only
    assert got[2] == got[1]
    fingerprint, num_docs, parts, skipped, capped, _ = got[1]
    assert len(parts) > 2 and skipped == ([str(src / "08-broken.jsonl")] if not max_bytes else [])
    # the cap lands inside a later file, one the workers read ahead
    assert (capped == max_bytes) and (40 < num_docs < 120 if max_bytes else num_docs > 250)
    assert not list(tmp_path.glob("**/read-ahead/*"))


def test_a_mistake_in_a_file_read_ahead_is_the_same_one_line_and_nothing_is_stored(tmp_path, monkeypatch):
    from stoker.data import sources

    monkeypatch.setattr(sources, "READ_AHEAD_BYTES", 0)
    src = _mixed_folder(tmp_path / "src")
    (src / "05-part.jsonl").write_text('{"text": "fine"}\nnot json at all\n')
    store = Store(f"file://{tmp_path}/store")
    cfg = DataConfig(source=str(src), num_workers=2, on_decode_error="skip")
    with pytest.raises(DataError, match=r"05-part.jsonl line 2 is not JSON"):
        data_prep.download_dataset(cfg, store)
    assert not store.walk_files("datasets")  # the parts stored before it were taken back


def test_an_s3_folder_read_ahead_fetches_in_the_workers_and_is_the_same_dataset(s3_root, tmp_path, monkeypatch):
    """On S3 each worker fetches its own file (its listed size checked) and deletes it once
    read: the same dataset as one reader's."""
    import s3fs

    from stoker.data import sources

    monkeypatch.setattr(sources, "READ_AHEAD_BYTES", 0)
    root, options = s3_root
    bucket = root.split("/")[2]
    fs = s3fs.S3FileSystem(**options)
    for k in range(3):
        fs.pipe_file(f"{bucket}/src/{k}.jsonl", _records(20 + k, tag=f"s3-{k}").encode())
    got = []
    for workers in (1, 2):
        cfg = DataConfig(source=f"s3://{bucket}/src/", storage_options=options, num_workers=workers)
        ds = data_prep.download_dataset(cfg, Store(f"file://{tmp_path}/store-{workers}"))
        got.append((ds.fingerprint, ds.num_docs))
    assert got[0] == got[1] and got[0][1] == 63
