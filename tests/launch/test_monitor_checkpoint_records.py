"""Checkpoints never committed (dropped from the upload backlog, or failed) reach the flow log
and TrainingResult.failed_checkpoints, once per step whatever the number of ranks saying so."""

import pytest

from core import events
from core.config import ConfigError, load_config
from core.results import TrainingResult
from launch.monitor import TrainingMonitor
from tests.conftest import tiny_dict


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)

    warning = error = info


def test_dropped_and_failed_checkpoints_are_listed_once_with_their_reason():
    result = TrainingResult(final_step=0, final_checkpoint_key=None, final_checkpoint_uri=None,
                            resumed_from_step=0, attempts=1, seconds=0.0)
    log = _Log()
    monitor = TrainingMonitor(result, 30, log, on_progress=lambda pct: None, on_commit=None)
    for rank in (0, 1):
        monitor(events.CheckpointDropped(step=4, rank=rank, reason="step 8 was written while 2 older "
                                         "checkpoint(s) waited for upload"))
        monitor(events.CheckpointFailed(step=12, rank=rank, error="NoSuchBucket: gone"))
    monitor(events.from_dict(events.CheckpointDropped(step=8, rank=0, reason="r").to_dict()))
    assert result.failed_checkpoints == [4, 12, 8]
    assert any("step 4 was dropped" in line and "waited for upload" in line for line in log.lines)
    assert any("NoSuchBucket" in line for line in log.lines)


def test_max_pending_uploads_below_one_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.max_pending_uploads") as err:
        load_config(tiny_dict("file://" + str(tmp_path), checkpoint={"max_pending_uploads": 0}))
    assert "give at least 1" in str(err.value)
