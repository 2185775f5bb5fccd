from stoker.config import ConfigError
from stoker.failures import DataError, TrainingFailed, is_transient


def test_user_mistakes_are_never_retried():
    assert not is_transient(ConfigError(["train.lr: must be > 0"]))
    assert not is_transient(DataError("data.source: empty"))
    assert not is_transient(FileNotFoundError("no such file"))
    assert not is_transient(TrainingFailed("bug", transient=False, reason="error"))
    assert not is_transient(MemoryError())


def test_lost_nodes_and_storage_blips_are_retried():
    assert is_transient(TrainingFailed("lost", transient=True, reason="lost-rank"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError("503 Slow Down"))


def test_rank_side_classification():
    from stoker.failures import is_transient as rank_transient

    lost_peer = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert rank_transient(lost_peer)
    assert rank_transient(OSError("503 Service Unavailable"))
    assert not rank_transient(RuntimeError("injected fault at step 3"))
    assert not rank_transient(FileNotFoundError("shards/abc/manifest.json"))
    assert not rank_transient(ValueError("checkpoint lacks entries"))
