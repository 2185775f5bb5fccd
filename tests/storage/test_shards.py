from storage.shards import shard_cache_key


def test_cache_key_depends_on_content_and_parameters_only():
    base = shard_cache_key("fp", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base == shard_cache_key("fp", "tok", {"shard_tokens": 100, "val_fraction": 0.1})
    assert base != shard_cache_key("fp2", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok2", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok", {"val_fraction": 0.2, "shard_tokens": 100})


import os
import threading

import pytest

from core.failures import DataError
from storage.shards import materialize


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
    threads = [threading.Thread(target=lambda: folders.append(materialize(store, key, cache)))
               for _ in range(3)]  # three ranks of one host at once
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
    with pytest.raises(DataError, match=f"damaged: {name}.*run the data stage again"):
        materialize(store, key, str(tmp_path / "fresh-host"))
    assert not os.path.exists(os.path.join(str(tmp_path / "fresh-host"), "shards", key))
