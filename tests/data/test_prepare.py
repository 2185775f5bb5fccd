import json
import os

import numpy as np
import pytest

from stoker.config import DataConfig, TokenizerConfig
from stoker.data import prepare as data_prep
from stoker.failures import DataError
from stoker.storage.shards import validate_shard_set
from stoker.storage.store import Store


@pytest.fixture
def store(tmp_path):
    return Store("file://" + str(tmp_path / "store"))


def _prepare(store, data=None, tok=None):
    data = data or DataConfig(max_bytes=200_000, val_fraction=0.1)
    tok = tok or TokenizerConfig(vocab_size=300)
    ds = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(ds, tok, store)
    return ds, tk, data_prep.tokenize_and_shard(ds, tk, data, store)


def test_shards_hold_every_document_with_end_of_text(store):
    ds, tk, shards = _prepare(store)
    folder = store.local_path(shards.key)
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    assert manifest["dtype"] == "<u2" and manifest["vocab_size"] == tk.vocab_size
    docs = 0
    for split in ("train", "val"):
        for name in manifest["splits"][split]:
            tokens = np.fromfile(os.path.join(folder, name), dtype="<u2")
            ends = np.fromfile(os.path.join(folder, name.replace(".bin", ".idx")), dtype="<u8")
            assert len(tokens) == manifest["files"][name]["tokens"] == ends[-1]
            assert (tokens[ends - 1] == tk.eot_id).all()  # every document ends in EOT
            docs += len(ends)
    assert docs == ds.num_docs
    assert shards.num_val_tokens > 0 and shards.num_train_tokens > 5 * shards.num_val_tokens


def test_shards_hold_every_token_of_every_document_even_cut_in_pieces(store, monkeypatch):
    """A long document is cut in pieces (sharding.PIECE_TOKENS, each to the split its hash picks,
    each an entry of the index, which the manifest's num_docs counts): every token of every
    document is in the shards all the same, and one end-of-text per document."""
    from tokenizers import Tokenizer

    from stoker.data import sharding

    monkeypatch.setattr(sharding, "PIECE_TOKENS", 64)  # the stdlib's files are long: many pieces
    ds, tk, shards = _prepare(store)
    folder = store.local_path(shards.key)
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    stored = np.concatenate(
        [np.fromfile(os.path.join(folder, n), dtype="<u2") for s in ("train", "val") for n in manifest["splits"][s]]
    )
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    docs = list(data_prep.iter_corpus(store, ds))
    ids = [e.ids for e in tok.encode_batch_fast(docs)]
    want = np.bincount(np.concatenate([np.asarray(i + [tk.eot_id]) for i in ids]), minlength=tk.vocab_size)
    assert np.array_equal(np.bincount(stored, minlength=tk.vocab_size), want)  # the same tokens, each as often
    assert int((stored == tk.eot_id).sum()) == len(docs) == ds.num_docs
    assert sum(manifest["num_docs"].values()) > len(docs)  # entries: the pieces, not the documents


def test_second_preparation_does_no_tokenization(store):
    _, _, first = _prepare(store)
    folder = store.local_path(first.key)
    mtimes = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}
    ds, tk, second = _prepare(store)
    assert (ds.cache_hit, tk.cache_hit, second.cache_hit) == (True, True, True)
    assert second.cache_key == first.cache_key
    assert mtimes == {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}


def test_cache_key_ignores_where_the_data_came_from(store, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "corpus.txt").write_text("hello world, a small corpus.\n\n" * 400)
    _, _, sa = _prepare(store, DataConfig(source=str(a), val_fraction=0.2))
    _, _, sb = _prepare(store, DataConfig(source=str(b / "*.txt"), val_fraction=0.2))
    assert sa.cache_key == sb.cache_key and sb.cache_hit


def test_a_shard_set_damaged_in_the_store_is_marked_where_read_and_rebuilt_by_the_next_stage(store, tmp_path):
    from stoker.storage.shards import materialize

    _, _, first = _prepare(store)
    path = os.path.join(store.local_path(first.key), "train-00000.bin")
    good = open(path, "rb").read()
    data = bytearray(good)
    data[10] ^= 0xFF
    open(path, "wb").write(bytes(data))  # same size: only a full check sees it
    _, _, hit = _prepare(store)
    assert hit.cache_hit  # choosing reads no shard byte
    with pytest.raises(
        DataError,
        match="damaged: train-00000.bin fails its sha256 checksum; it is marked invalid.*data stage again rebuilds it",
    ):
        materialize(store, first.cache_key, str(tmp_path / "host"))
    assert not validate_shard_set(store, first.cache_key)  # the marker: no rank loops on it
    with pytest.raises(DataError, match="marked invalid by a host that read it"):
        materialize(store, first.cache_key, str(tmp_path / "host"))
    _, _, again = _prepare(store)
    assert not again.cache_hit and validate_shard_set(store, first.cache_key, deep=True)
    assert open(path, "rb").read() == good
    assert materialize(store, first.cache_key, str(tmp_path / "host")) == store.local_path(first.key)


def ds_parts(store, ds):
    from stoker.storage.datasets import dataset_parts

    return dataset_parts(store, ds.fingerprint)


def test_jsonl_text_field_and_a_missing_field(store, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"body": f"document number {i} " * 20}) for i in range(200)))
    ds = data_prep.download_dataset(DataConfig(source=str(good), text_field="body"), store)
    assert ds.num_docs == 200
    with pytest.raises(DataError, match="data.text_field.*'text'"):
        data_prep.download_dataset(DataConfig(source=str(good)), store)
    assert set(store.listdir("datasets")) - {"parts"} == {ds.fingerprint, "by-source"}  # nothing half-written
    assert set(store.walk_files("datasets/parts")) == {
        p.key.removeprefix("datasets/parts/") for p in ds_parts(store, ds)
    }
    assert len(store.listdir("datasets/by-source")) == 1  # the good source's link only


def test_the_same_documents_in_another_format_are_stored_and_tokenized_once(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document {i}: " + "words of text " * (5 + i % 7) for i in range(300)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"text": docs, "id": list(range(300))}), tmp_path / "c.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d + "!"}) + "\n" for d in docs))
    as_jsonl, tok, first = _prepare(store, DataConfig(source=str(tmp_path / "c.jsonl"), val_fraction=0.1))
    as_parquet, tok2, second = _prepare(store, DataConfig(source=str(tmp_path / "c.parquet"), val_fraction=0.1))
    assert as_parquet.fingerprint == as_jsonl.fingerprint and as_parquet.key == as_jsonl.key
    assert as_parquet.cache_hit and tok2.sha256 == tok.sha256
    assert second.cache_hit and second.cache_key == first.cache_key  # tokenized once
    links = store.listdir("datasets/by-source")
    assert len(links) == 2 and set(store.listdir("datasets")) == {as_jsonl.fingerprint, "by-source", "parts"}
    assert len(store.walk_files("datasets/parts")) == len(ds_parts(store, as_jsonl))  # the parts stored once
    again = data_prep.download_dataset(DataConfig(source=str(tmp_path / "c.parquet"), val_fraction=0.1), store)
    assert again.cache_hit and again.fingerprint == as_jsonl.fingerprint
    other = data_prep.download_dataset(DataConfig(source=str(tmp_path / "d.jsonl"), val_fraction=0.1), store)
    assert not other.cache_hit and other.fingerprint != as_jsonl.fingerprint  # other documents


def test_bad_sources_fail_clearly_and_write_nothing(store, tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="no non-empty document"):
        data_prep.download_dataset(DataConfig(source=str(tmp_path / "empty.txt")), store)
    with pytest.raises(DataError, match="not UTF-8"):
        data_prep.download_dataset(DataConfig(source=str(tmp_path / "binary.txt")), store)
    assert not store.exists("datasets")


def test_too_few_documents_for_a_validation_split_leaves_no_staging(store, tmp_path):
    (tmp_path / "one.txt").write_text("only one short document")
    data = DataConfig(source=str(tmp_path / "one.txt"), val_fraction=0.01)
    with pytest.raises(DataError, match="split got no document"):
        _prepare(store, data)
    assert store.listdir("shards") == []


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MB filesystem (tmpfs; needs root)."""
    import subprocess

    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_shards_that_would_not_fit_on_the_disk_are_refused_before_tokenizing(small_disk, tmp_path):
    """The store is a 3 MB disk holding a 1.8 MB corpus (data.max_bytes): its shards (about
    2.9 MB of uint16 token ids at this tiny vocabulary) do not fit in what is left. One DataError naming storage.root, sizes and the
    fix; nothing of the shard set is left. The same data on a big disk builds."""
    rng = np.random.default_rng(0)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, size=rng.integers(2, 9))) for _ in range(3000)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words, size=60)) for _ in range(5000)))
    data = DataConfig(source=str(corpus), val_fraction=0.1)
    store = Store(f"file://{small_disk}/store")
    ds = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=300), store)
    with pytest.raises(
        DataError,
        match=r"storage.root: tokenizing [\d.]+ MB of text needs about [\d.]+ MB on "
        r".*and [\d.]+ MB are free; free space there or point storage.root at a bigger disk",
    ):
        data_prep.tokenize_and_shard(ds, tk, data, store)
    assert not store.exists("shards") or not store.walk_files("shards")  # no shards, no staging
    big = Store(f"file://{tmp_path}/big")
    _, _, shards = _prepare(big, data, TokenizerConfig(vocab_size=300))
    built = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(big.local_path(shards.key))
        for f in fs
        if f.endswith(".bin")
    )
    assert built > 1.5e6  # what the estimate was about: it would not have fit


def test_a_source_cut_at_max_bytes_says_so_and_one_taken_whole_does_not(store, tmp_path):
    """data.max_bytes (3 MB by default, for the built-in corpus) cuts a user's folder too: the
    dataset says where (its info and DatasetInfo.capped_at, which the download task logs as a
    warning naming the field and the fix); nothing cut: 0."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 100}) + "\n" for i in range(20))
    )
    cut = data_prep.download_dataset(DataConfig(source=str(tmp_path / "src"), max_bytes=5000), store)
    whole = data_prep.download_dataset(DataConfig(source=str(tmp_path / "src"), max_bytes=0), store)
    assert cut.capped_at == 5000 and 0 < cut.num_docs < 20
    assert whole.capped_at == 0 and whole.num_docs == 20
    again = data_prep.download_dataset(DataConfig(source=str(tmp_path / "src"), max_bytes=5000), store)
    assert again.cache_hit and again.capped_at == 5000  # a cache hit says it too
