import os
import threading

import pytest

from stoker.failures import DataError
from stoker.storage.shards import materialize, shard_cache_key


def test_cache_key_depends_on_content_and_parameters_only():
    base = shard_cache_key("fp", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base == shard_cache_key("fp", "tok", {"shard_tokens": 100, "val_fraction": 0.1})
    assert base != shard_cache_key("fp2", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok2", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok", {"val_fraction": 0.2, "shard_tokens": 100})


@pytest.fixture(params=["local", "s3"])
def shard_store(request, tmp_path, tiny_config):
    """A real shard set (the data stage on a tiny corpus) in a local or an S3 store."""
    from tests.conftest import prepare_shards

    if request.param == "local":
        store, shards = prepare_shards(tiny_config())
        return store, shards.key.rsplit("/", 1)[-1]
    root, options = request.getfixturevalue("s3_root")
    cfg = tiny_config(storage={"root": root, "storage_options": options})
    store, shards = prepare_shards(cfg)
    return store, shards.key.rsplit("/", 1)[-1]


def test_shards_are_fully_checked_once_per_host_under_a_lock(shard_store, tmp_path):
    store, key = shard_store
    cache = str(tmp_path / "host-cache")
    folders = []
    threads = [
        threading.Thread(target=lambda: folders.append(materialize(store, key, cache))) for _ in range(3)
    ]  # three ranks of one host at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(folders)) == 1 and os.path.exists(os.path.join(folders[0], "manifest.json"))
    assert [n for n in os.listdir(os.path.join(cache, "shards")) if ".tmp-" in n] == []


def test_a_damaged_shard_set_is_refused_with_the_fix(shard_store, tmp_path):
    store, key = shard_store
    name = sorted(n for n in store.walk_files(f"shards/{key}") if n.endswith(".bin"))[0]
    data = store.read_bytes(f"shards/{key}/{name}")
    store.write_bytes(f"shards/{key}/{name}", data[:10] + bytes([data[10] ^ 1]) + data[11:])
    with pytest.raises(DataError, match=f"damaged: {name}.*data stage again rebuilds it"):
        materialize(store, key, str(tmp_path / "fresh-host"))
    assert not os.path.exists(os.path.join(str(tmp_path / "fresh-host"), "shards", key))


def _flip_in_place(path: str, offset: int = 10) -> None:
    """Flip one byte of a file in place, keeping its size and (reset) mtime."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_damaged_host_cache_copy_of_shards_is_dropped_and_fetched_again(s3_root, tiny_config, tmp_path, caplog):
    from tests.conftest import prepare_shards

    root, options = s3_root
    store, shards = prepare_shards(tiny_config(storage={"root": root, "storage_options": options}))
    key = shards.key.rsplit("/", 1)[-1]
    cache = str(tmp_path / "host-cache")
    local = materialize(store, key, cache)
    name = sorted(n for n in os.listdir(local) if n.endswith(".bin"))[0]
    good = store.read_bytes(f"shards/{key}/{name}")
    assert open(os.path.join(local, name), "rb").read() == good
    _flip_in_place(os.path.join(local, name))  # the cache's copy, not the store's
    with caplog.at_level("WARNING", logger="stoker.host_cache"):
        again = materialize(store, key, cache)
    assert again == local and open(os.path.join(local, name), "rb").read() == good
    assert f"{name} fails its sha256 checksum" in caplog.text and "fetching it again" in caplog.text


def test_a_cache_hit_reads_no_byte_while_its_stamp_holds(s3_root, tiny_config, tmp_path, monkeypatch):
    import stoker.storage.cache
    from tests.conftest import prepare_shards

    root, options = s3_root
    store, shards = prepare_shards(tiny_config(storage={"root": root, "storage_options": options}))
    key = shards.key.rsplit("/", 1)[-1]
    cache = str(tmp_path / "host-cache")
    materialize(store, key, cache)
    hashed = []
    real = stoker.storage.cache.sha256_file
    monkeypatch.setattr(stoker.storage.cache, "sha256_file", lambda p: hashed.append(p) or real(p))
    materialize(store, key, cache)
    assert hashed == []
    os.utime(os.path.join(cache, "shards", key, "manifest.json"))  # not a listed file: no effect
    name = sorted(n for n in os.listdir(os.path.join(cache, "shards", key)) if n.endswith(".idx"))[0]
    os.utime(os.path.join(cache, "shards", key, name))  # touched, not changed: hashed, re-stamped
    materialize(store, key, cache)
    assert hashed and materialize(store, key, cache) and len(hashed) == len(set(hashed))


def test_a_cache_hit_of_the_data_stage_reads_only_manifests(s3_root, tiny_config, monkeypatch):
    """Choosing a cached shard set reads its manifest, not its shards: the full check happens
    where the bytes land (materialize, on each host)."""
    import s3fs

    from stoker.data import prepare as data_prep
    from tests.conftest import prepare_shards

    root, options = s3_root
    cfg = tiny_config(storage={"root": root, "storage_options": options})
    store, shards = prepare_shards(cfg)
    dataset = data_prep.download_dataset(cfg.data, store)
    tokenizer = data_prep.train_tokenizer(dataset, cfg.tokenizer, store)
    reads = []  # (object name, bytes) of every GET the data stage makes
    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        out = await real(self, method, *args, **kwargs)
        if method == "get_object":
            reads.append((kwargs.get("Key", "").rsplit("/", 1)[-1], out["ContentLength"]))
        return out

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    again = data_prep.tokenize_and_shard(dataset, tokenizer, cfg.data, store)
    assert again.cache_hit
    shard_bytes = sum(e["size"] for e in store.read_json(f"{shards.key}/manifest.json")["files"].values())
    assert reads and {name for name, _ in reads} == {"manifest.json"}, reads
    assert sum(n for _, n in reads) < shard_bytes / 10


def test_a_shard_set_damaged_in_the_store_is_marked_and_rebuilt_by_the_next_data_stage(s3_root, tiny_config, tmp_path):
    from stoker.storage.manifest import INVALID_MARKER
    from tests.conftest import prepare_shards

    root, options = s3_root
    cfg = tiny_config(storage={"root": root, "storage_options": options})
    store, shards = prepare_shards(cfg)
    key = shards.key.rsplit("/", 1)[-1]
    name = sorted(n for n in store.walk_files(shards.key) if n.endswith(".bin"))[0]
    good = store.read_bytes(f"{shards.key}/{name}")
    store.write_bytes(f"{shards.key}/{name}", good[:10] + bytes([good[10] ^ 1]) + good[11:])
    assert prepare_shards(cfg)[1].cache_hit  # same size: the cheap choice does not see it
    with pytest.raises(
        DataError,
        match=f"damaged: {name} fails its sha256 checksum \\(as downloaded\\); "
        "it is marked invalid.*data stage again rebuilds it",
    ):
        materialize(store, key, str(tmp_path / "host-a"))
    assert store.exists(f"{shards.key}/{INVALID_MARKER}", refresh=True)
    # a retried rank, or another host: refused at once, nothing downloaded or kept
    with pytest.raises(DataError, match=f"marked invalid by a host that read it \\({name} fails"):
        materialize(store, key, str(tmp_path / "host-b"))
    assert not os.path.exists(os.path.join(str(tmp_path / "host-b"), "shards", key))
    rebuilt = prepare_shards(cfg)[1]
    assert not rebuilt.cache_hit and rebuilt.cache_key == key
    assert not store.exists(f"{shards.key}/{INVALID_MARKER}", refresh=True)
    assert store.read_bytes(f"{shards.key}/{name}") == good
    local = materialize(store, key, str(tmp_path / "host-a"))
    assert open(os.path.join(local, name), "rb").read() == good
    assert prepare_shards(cfg)[1].cache_hit
