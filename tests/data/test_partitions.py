"""A source stored as partitions (stoker.storage.datasets): a folder's files stay parts of their
own, a big file is cut, each part is stored by its content as it is made; the dataset's identity
and the shard bytes do not depend on the partitioning; a grown folder stores, and deduplicates,
only its new parts; a file rolled back (not UTF-8) leaves nothing of itself in the store."""

from __future__ import annotations

import json
import os
import random

import pytest

from stoker.config import DataConfig, EvalConfig, TokenizerConfig
from stoker.data import dedup, dedup_units
from stoker.data import prepare as data_prep
from stoker.failures import DataError
from stoker.storage.datasets import dataset_parts
from stoker.storage.store import Store

PART = 50_000  # bytes of a stored part here (data.partition_bytes is 8 MiB by default)


def _records(prefix: str, n: int, words: int = 40) -> str:
    """n documents of random words (seeded by the prefix: the same prefix, the same documents)."""
    rng = random.Random(prefix)
    return "".join(
        json.dumps({"text": f"{prefix} {i} " + " ".join(f"w{rng.randrange(5000)}" for _ in range(words))}) + "\n"
        for i in range(n)
    )


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(data_prep, "PARTITION_BYTES", PART)


def _folder(root, files: dict[str, str]):
    root.mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def _stored(store) -> set[str]:
    return set(store.walk_files("datasets/parts"))


def test_a_folder_keeps_its_files_as_parts_and_a_grown_folder_stores_only_its_new_parts(small_parts, tmp_path):
    files = {"a.jsonl": _records("a", 80), "b.jsonl": _records("b", 800), "c.jsonl": _records("c", 90)}
    assert 12_500 < len(files["a.jsonl"]) < PART and len(files["b.jsonl"]) > 3 * PART
    src = _folder(tmp_path / "src", files)
    store = Store(f"file://{tmp_path}/store")
    ds = data_prep.download_dataset(DataConfig(source=str(src)), store)
    parts = dataset_parts(store, ds.fingerprint)
    sizes = [p.size for p in parts]
    assert sizes[0] == len(files["a.jsonl"]) and sizes[-1] == len(files["c.jsonl"])  # a file, a part
    assert len(parts) >= 5 and all(s >= PART for s in sizes[1:-2])  # b cut where a part is full
    assert sum(p.num_docs for p in parts) == ds.num_docs == 970
    assert _stored(store) == {p.key.removeprefix("datasets/parts/") for p in parts}
    # the identity is the documents': one file of the same lines is the same dataset
    one = tmp_path / "one.jsonl"
    one.write_text("".join(files[n] for n in sorted(files)))
    same = data_prep.download_dataset(DataConfig(source=str(one)), Store(f"file://{tmp_path}/other"))
    assert same.fingerprint == ds.fingerprint
    # grown: a file added at the end and one between; the other files' parts are reused
    before = _stored(store)
    (src / "d.jsonl").write_text(_records("d", 70))
    (src / "b2.jsonl").write_text(_records("b2", 60))
    grown = data_prep.download_dataset(DataConfig(source=str(src)), store)
    new_parts = dataset_parts(store, grown.fingerprint)
    added = _stored(store) - before
    assert grown.fingerprint != ds.fingerprint and grown.num_docs == 970 + 130
    assert len(added) == 2 and {p.num_docs for p in new_parts if p.key.removeprefix("datasets/parts/") in added} == {
        60,
        70,
    }
    assert [p for p in new_parts if p.num_docs not in (60, 70)] == parts  # every earlier part as it was


def test_the_shards_are_the_same_bytes_whatever_the_parts(monkeypatch, tmp_path):
    src = _folder(tmp_path / "src", {"a.jsonl": _records("a", 500), "b.jsonl": _records("b", 400)})
    built = []
    for part_bytes in (None, PART):
        monkeypatch.setattr(data_prep, "PARTITION_BYTES", part_bytes)
        store = Store(f"file://{tmp_path}/store-{part_bytes}")
        data = DataConfig(source=str(src), val_fraction=0.1, shard_tokens=4096, num_workers=2)
        ds = data_prep.download_dataset(data, store)
        tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=400), store)
        shards = data_prep.tokenize_and_shard(ds, tk, data, store, partition_bytes=30_000)
        manifest = store.read_json(f"{shards.key}/manifest.json")
        built.append(
            (
                len(dataset_parts(store, ds.fingerprint)),
                ds.fingerprint,
                {n: store.read_bytes(f"{shards.key}/{n}") for n in manifest["files"]},
            )
        )
    assert built[0][0] == 1 and built[1][0] >= 4
    assert built[0][1] == built[1][1] and built[0][2] == built[1][2]


def test_a_grown_source_computes_the_dedup_features_of_its_new_parts_only(small_parts, tmp_path, monkeypatch):
    src = _folder(tmp_path / "src", {"a.jsonl": _records("a", 300), "b.jsonl": _records("b", 300) + _records("a", 5)})
    store = Store(f"file://{tmp_path}/store")
    computed = []
    real = dedup_units._features
    monkeypatch.setattr(
        dedup_units, "_features", lambda store, folder, *a: computed.append(folder) or real(store, folder, *a)
    )

    def run():
        data = DataConfig(source=str(src), dedup="near")
        ds = data_prep.download_dataset(data, store)
        return dedup.dedup_sources([ds], [("main", data)], store, EvalConfig())[0][1]

    first = run()
    n_first = len(computed)
    assert (first.num_exact, first.num_near) == (5, 0) and n_first == len(
        dataset_parts(store, first_ds_fp(store, src))
    ) >= 4
    (src / "c.jsonl").write_text(_records("c", 90) + _records("b", 3))
    grown = run()
    assert (grown.num_exact, grown.num_near) == (8, 0) and not grown.cache_hit
    assert len(computed) - n_first == 1  # the new file's one part


def first_ds_fp(store, src) -> str:
    return data_prep.download_dataset(DataConfig(source=str(src)), store).fingerprint


def test_a_file_rolled_back_across_parts_leaves_nothing_of_itself(small_parts, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(_records("a", 60))
    # valid for several parts' worth, then a bad byte: the parts it filled are taken back
    (src / "b.txt").write_bytes(("fine line " * 30 + "\n\n").encode() * 800 + b"\xff\xfe broken\n")
    (src / "c.jsonl").write_text(_records("c", 50))
    store = Store(f"file://{tmp_path}/store")
    with pytest.raises(DataError, match="b.txt is not UTF-8"):
        data_prep.download_dataset(DataConfig(source=str(src)), store)
    assert _stored(store) == set()  # nothing half-written
    ds = data_prep.download_dataset(DataConfig(source=str(src), on_decode_error="skip"), store)
    docs = list(data_prep.iter_corpus(store, ds))
    assert ds.num_skipped_files == 1 and len(docs) == 110 and not any("fine line" in d for d in docs)
    assert _stored(store) == {p.key.removeprefix("datasets/parts/") for p in dataset_parts(store, ds.fingerprint)}
    assert len(os.listdir(tmp_path)) == 2  # the source and the store: no local part left behind


def test_a_grown_source_tokenizes_only_its_new_partitions_into_the_same_shard_bytes(small_parts, tmp_path, monkeypatch):
    """Tokenized partitions are cached by content (storage.tokenized): with the same tokenizer
    (a base's), a grown source tokenizes its new partitions only, and its shards are the bytes a
    build from nothing gives."""
    from stoker.data import sharding

    tokenized = []
    real = sharding.tokenize_partition
    monkeypatch.setattr(sharding, "tokenize_partition", lambda job: tokenized.append(job.index) or real(job))
    src = _folder(tmp_path / "src", {"a.jsonl": _records("a", 300), "b.jsonl": _records("b", 300)})
    data = DataConfig(source=str(src), val_fraction=0.1, shard_tokens=4096, num_workers=1)
    store = Store(f"file://{tmp_path}/store")
    first = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(first, TokenizerConfig(vocab_size=400), store)
    data_prep.tokenize_and_shard(first, tk, data, store, partition_bytes=30_000)
    n_first = len(tokenized)
    assert n_first >= 4 and len(store.walk_files("tokenized")) == 5 * n_first  # 4 files and counts.json each
    (src / "c.jsonl").write_text(_records("c", 60))
    grown = data_prep.download_dataset(data, store)
    shards = data_prep.tokenize_and_shard(grown, tk, data, store, partition_bytes=30_000)
    assert len(tokenized) - n_first == 1  # c.jsonl: one part, one partition
    fresh_store = Store(f"file://{tmp_path}/fresh")  # the same tokenizer, nothing tokenized before
    fresh_store.put_file(store.local_path(tk.key), tk.key)
    fresh = data_prep.tokenize_and_shard(
        data_prep.download_dataset(data, fresh_store), tk, data, fresh_store, partition_bytes=30_000
    )
    names = store.read_json(f"{shards.key}/manifest.json")["files"]
    assert names == fresh_store.read_json(f"{fresh.key}/manifest.json")["files"]
    assert all(store.read_bytes(f"{shards.key}/{n}") == fresh_store.read_bytes(f"{fresh.key}/{n}") for n in names)
    # an entry without its commit is no entry: made again
    entry = sorted({k.rsplit("/", 1)[0] for k in store.walk_files("tokenized")})[0]
    store.rm(f"tokenized/{entry}/counts.json")
    store.rm(shards.key)
    before = len(tokenized)
    data_prep.tokenize_and_shard(grown, tk, data, store, partition_bytes=30_000)
    assert len(tokenized) - before == 1


def test_on_an_object_store_a_grown_source_copies_and_tokenizes_only_its_new_partition(
    small_parts, s3_root, tmp_path, monkeypatch
):
    """On S3 (a moto server over HTTP) the cache's probes and the copies of the parts to
    tokenize run in parallel (prepare.STORE_THREADS): a grown source copies the part of its new
    partition alone, tokenizes it alone, and its shards are the bytes a local store's give."""
    from stoker.data import sharding

    tokenized, copied = [], []
    real = sharding.tokenize_partition
    monkeypatch.setattr(sharding, "tokenize_partition", lambda job: tokenized.append(job.index) or real(job))
    root, options = s3_root
    store = Store(root, options)
    real_get = store.get_file
    monkeypatch.setattr(store, "get_file", lambda key, path: copied.append(key) or real_get(key, path))
    src = _folder(tmp_path / "src", {"a.jsonl": _records("a", 300), "b.jsonl": _records("b", 300)})
    data = DataConfig(source=str(src), val_fraction=0.1, shard_tokens=4096, num_workers=1)
    first = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(first, TokenizerConfig(vocab_size=400), store)
    data_prep.tokenize_and_shard(first, tk, data, store, partition_bytes=30_000)
    (src / "c.jsonl").write_text(_records("c", 60))
    grown = data_prep.download_dataset(data, store)
    n_tokenized, parts_before = len(tokenized), [k for k in copied if k.startswith("datasets/parts/")]
    shards = data_prep.tokenize_and_shard(grown, tk, data, store, partition_bytes=30_000)
    assert len(tokenized) - n_tokenized == 1  # c.jsonl: one part, one partition
    parts_now = [k for k in copied if k.startswith("datasets/parts/")][len(parts_before) :]
    [new_part] = [p.key for p in dataset_parts(store, grown.fingerprint) if p.key not in parts_before]
    assert parts_now == [new_part]  # the parts of cached partitions are not copied here
    local = Store(f"file://{tmp_path}/local")
    with open(tmp_path / "tok.json", "wb") as f:
        f.write(store.read_bytes(tk.key))
    local.put_file(str(tmp_path / "tok.json"), tk.key)
    fresh = data_prep.tokenize_and_shard(
        data_prep.download_dataset(data, local), tk, data, local, partition_bytes=30_000
    )
    names = store.read_json(f"{shards.key}/manifest.json")["files"]
    assert names == local.read_json(f"{fresh.key}/manifest.json")["files"]
    assert all(store.read_bytes(f"{shards.key}/{n}") == local.read_bytes(f"{fresh.key}/{n}") for n in names)
