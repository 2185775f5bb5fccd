from tasks.data_prep import DataError
from tasks.launcher import TrainingFailed
from tasks.policy import is_transient
from training.config import ConfigError


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
