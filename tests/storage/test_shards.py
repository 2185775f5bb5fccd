from storage.shards import shard_cache_key


def test_cache_key_depends_on_content_and_parameters_only():
    base = shard_cache_key("fp", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base == shard_cache_key("fp", "tok", {"shard_tokens": 100, "val_fraction": 0.1})
    assert base != shard_cache_key("fp2", "tok", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok2", {"val_fraction": 0.1, "shard_tokens": 100})
    assert base != shard_cache_key("fp", "tok", {"val_fraction": 0.2, "shard_tokens": 100})
