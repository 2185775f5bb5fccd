from stoker.contracts import events
from stoker.contracts.results import TrainingResult
from stoker.launch.monitor import TrainingMonitor


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)

    warning = error = info


def test_committed_checkpoint_is_recorded_by_its_key_whatever_the_root_spelling():
    result = TrainingResult(
        final_step=0, final_checkpoint_key=None, final_checkpoint_uri=None, resumed_from_step=0, attempts=1, seconds=0.0
    )
    submitted = []
    monitor = TrainingMonitor(
        result, 30, _Log(), on_progress=lambda pct: None, on_commit=lambda key, step: submitted.append(key)
    )
    key = "runs/smoke/checkpoints/step-00000015"
    # a root given as a bare path is stored as file://...: the key is never cut out of the URL
    monitor(
        events.CheckpointCommitted(
            step=15,
            key=key,
            uri="file:///tmp/store/" + key,
            bytes=10,
            stage_seconds=0.1,
            upload_seconds=0.2,
            commit_seconds=0.3,
        )
    )
    assert result.final_checkpoint_key == key and submitted == [key]


def test_dropped_and_failed_checkpoints_are_listed_once_with_their_reason():
    result = TrainingResult(
        final_step=0, final_checkpoint_key=None, final_checkpoint_uri=None, resumed_from_step=0, attempts=1, seconds=0.0
    )
    log = _Log()
    monitor = TrainingMonitor(result, 30, log, on_progress=lambda pct: None, on_commit=None)
    for rank in (0, 1):
        monitor(
            events.CheckpointDropped(
                step=4, rank=rank, reason="step 8 was written while 2 older checkpoint(s) waited for upload"
            )
        )
        monitor(events.CheckpointFailed(step=12, rank=rank, error="NoSuchBucket: gone"))
    monitor(events.from_dict(events.CheckpointDropped(step=8, rank=0, reason="r").to_dict()))
    assert result.failed_checkpoints == [4, 12, 8]
    assert any("step 4 was dropped" in line and "waited for upload" in line for line in log.lines)
    assert any("NoSuchBucket" in line for line in log.lines)
