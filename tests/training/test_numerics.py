"""The numerics guard: a NaN loss never goes on silently, a NaN state is never committed or
resumed from. Real ranks (the launcher's, or forked: tests.forked_ranks); the NaN comes from STOKER_FAULT=nan (a forward hook that
makes the training loss NaN), and the real check catches it."""

import json
import shutil

import pytest
import torch

from stoker.contracts.results import TrainingResult
from stoker.failures import TrainingFailed
from stoker.launch import make_launcher
from stoker.launch.attempts import launch_attempt, read_attempts
from stoker.launch.monitor import TrainingMonitor
from stoker.observe.inspect import list_checkpoint_folders, list_runs
from stoker.storage.checkpoints import find_latest_valid, list_checkpoints, validate_checkpoint
from tests.conftest import prepare_shards
from tests.forked_ranks import run_forked


def _stage(cfg, run):
    store, shards = prepare_shards(cfg)
    store.write_bytes(f"runs/{run}/config.json", cfg.to_json().encode())
    return store, shards


class _Log:
    """The flow's logger, kept as lines."""

    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    warning = error = info


def _launch(cfg, store, shards, run, fault):
    """One launch attempt as the training task makes it (launch_attempt: the real launcher,
    the monitor, attempts.jsonl); (TrainingFailed, the monitor's result, its log lines)."""
    launcher = make_launcher(cfg, store.url(f"runs/{run}/config.json"), shards.key, None)
    for env in launcher.gang.envs:
        env.update({"STOKER_FAULT": fault, "GLOO_SOCKET_IFNAME": "lo"} if fault else {})
    log = _Log()
    result = TrainingResult(
        final_step=0, final_checkpoint_key=None, final_checkpoint_uri=None, resumed_from_step=0, attempts=1, seconds=0.0
    )
    monitor = TrainingMonitor(result, cfg.train.max_steps, log, on_progress=lambda pct: None, on_commit=None)
    try:
        with pytest.raises(TrainingFailed) as failed:
            launch_attempt(launcher, monitor, store, run, "flow-run", 1, 0)
    finally:
        shutil.rmtree(launcher.work_dir, ignore_errors=True)
    _launch.tail = list(launcher.gang.tail)  # every line the gang printed, to its end
    return failed.value, monitor.result, log.lines


def _steps(store, run):
    return sorted(r.step for r in list_checkpoints(store, run) if validate_checkpoint(store, r.key))


# launch.max_restarts: a permanent failure ends the gang before torchrun restarts its ranks;
# one case allows a restart round and shows that none is spent (no rank starts again to read
# the marker and end: test_torchrun_resume's subject, the fallback)
@pytest.mark.parametrize(
    "fault,lr,log_interval,bad_step,max_restarts",
    [
        ("nan:rank=0:step=3", 1e-2, 4, 3, 1),  # an injected NaN loss, found on the next log step (4)
        ("", 1e6, 100, 2, 0),  # a real divergence (AdamW at lr 1e6 is NaN at step 2), found before a save
    ],
    ids=["injected-found-on-a-log-step", "diverging-lr-found-before-a-save"],
)
def test_nan_loss_fails_the_run_permanently_naming_the_step_and_commits_nothing_after_it(
    tiny_config, fault, lr, log_interval, bad_step, max_restarts
):
    run = "diverge"
    cfg = tiny_config(
        run_name=run,
        train={"max_steps": 8, "log_interval": log_interval, "lr": lr, "warmup_steps": 0, "min_lr": 0},
        checkpoint={"interval_steps": 2 if fault else 1},
        eval={"per_checkpoint_enabled": False, "interval_steps": 100},
        launch={"max_restarts": max_restarts},
    )
    store, shards = _stage(cfg, run)
    err, result, lines = _launch(cfg, store, shards, run, fault)
    what = f"non-finite loss at step {bad_step}"
    assert not err.transient, err  # permanent: the flow's retries do not run it again
    assert "NonFiniteError" in str(err) and what in str(err), str(err)
    # nothing from the bad step on is committed; the step before is
    assert _steps(store, run)[-1] == bad_step - 1, _steps(store, run)
    assert result.final_step == bad_step - 1 and all(s < bad_step for s, _ in result.train_losses)
    assert any(what in line for line in lines), lines[-30:]
    assert result.restarts == 0 and not any("not restarted" in line for line in _launch.tail), _launch.tail[-30:]
    [attempt] = read_attempts(store, run, "flow-run")
    assert attempt["outcome"] == "error" and what in attempt["error"]
    # `stoker runs` says why, and a resume takes the last finite checkpoint
    assert list_runs(cfg.storage.root)[0]["ended"] == f"failed: {what}"
    assert find_latest_valid(store, run).checkpoint.step == bad_step - 1


def test_skip_drops_a_transient_nan_step_and_the_run_completes(tiny_config):
    run = "skipper"
    cfg = tiny_config(
        run_name=run,
        train={"max_steps": 6, "nonfinite": "skip", "nonfinite_skip_limit": 2},
        checkpoint={"interval_steps": 3},
    )
    store, shards = _stage(cfg, run)
    records = run_forked(store.url(f"runs/{run}/config.json"), shards.key, env={"STOKER_FAULT": "nan:rank=0:step=3"})
    skipped = [r for r in records if r["event"] == "nonfinite"]
    assert [(r["step"], r["action"], r["what"]) for r in skipped] == [(3, "skipped", "loss")]
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    assert sorted(losses) == [1, 2, 4, 5, 6] and all(v == v for v in losses.values())
    assert any(r["event"] == "done" for r in records)
    assert _steps(store, run) == [3, 6]
    newest = find_latest_valid(store, run)
    assert newest.checkpoint.step == 6 and newest.manifest["numerics"] == "finite"


def test_skip_fails_once_past_its_limit(tiny_config):
    run = "toomany"
    cfg = tiny_config(
        run_name=run,
        train={"max_steps": 8, "nonfinite": "skip", "nonfinite_skip_limit": 2},
        checkpoint={"interval_steps": 2},
        eval={"per_checkpoint_enabled": False},
        launch={"max_restarts": 0},  # no restart round (see above)
    )
    store, shards = _stage(cfg, run)
    err, result, _ = _launch(cfg, store, shards, run, "nan:rank=1:step=3:count=3")
    assert not err.transient and "non-finite loss at step 5" in str(err), str(err)
    assert "nonfinite_skip_limit=2" in str(err)
    assert result.skipped_steps == [3, 4]
    # steps 3 and 4 were skipped (their updates dropped: the state stayed finite, step 4 saved)
    assert _steps(store, run) == [2, 4]


def _trainer(cfg, store, shards, tmp_path):
    from stoker.storage.shards import materialize
    from stoker.training.distributed import RankInfo
    from stoker.training.loop import Trainer

    cache, key = str(tmp_path / "cache"), shards.key.rsplit("/", 1)[-1]
    return Trainer(
        cfg, RankInfo(0, 0, 1, torch.device("cpu")), materialize(store, key, cache), store, key, cache_dir=cache
    )


def test_resume_passes_over_a_nan_checkpoint_committed_the_old_way(tiny_config, tmp_path):
    """A checkpoint of an older stoker: committed with NaN weights and no `numerics` in its
    manifest. The choice cannot see it (no metrics say so); the resume path's check of the
    loaded weights does: it is marked invalid and the ranks resume from the one before."""
    run = "oldnan"
    cfg = tiny_config(
        run_name=run, train={"max_steps": 8}, checkpoint={"async_enabled": False}, launch={"nproc_per_node": 1}
    )
    store, shards = _stage(cfg, run)
    trainer = _trainer(cfg, store, shards, tmp_path)
    try:
        for _ in range(2):
            trainer.train_step()
        trainer.save()  # step 2, checked: numerics finite
        for _ in range(2):
            trainer.train_step()
        with torch.no_grad():
            next(trainer.raw_model.parameters()).fill_(float("nan"))
        meta = {"model_hash": cfg.model_hash(), "run_name": run, "tokens_seen": trainer.tokens_seen}
        trainer.checkpointer.save(trainer.step, trainer.tokens_seen, meta)  # the old way
        trainer.uploader.wait()
    finally:
        trainer.batches.close()
    old = "runs/oldnan/checkpoints/step-00000004"
    assert validate_checkpoint(store, old) and "numerics" not in validate_checkpoint(store, old).manifest

    again = _trainer(cfg, store, shards, tmp_path)
    try:
        again.resume(old)
        assert again.step == 2
        assert all(torch.isfinite(p).all() for p in again.raw_model.parameters())
    finally:
        again.batches.close()
    rows = {r["step"]: r for r in list_checkpoint_folders(cfg.storage.root, run)}
    assert not rows[4]["valid"] and "NaN/inf" in rows[4]["reason"]
    assert find_latest_valid(store, run).checkpoint.step == 2


def test_an_old_checkpoint_after_a_logged_nan_loss_is_refused_without_reading_it(tiny_config, tmp_path):
    """metrics.jsonl of an older stoker logged loss NaN at step 3 and trained on: its later
    checkpoints (no `numerics` in the manifest) are passed over, and the listing says why."""
    from stoker.storage.checkpoints import commit_checkpoint

    run = "oldlog"
    cfg = tiny_config(run_name=run)
    store = _stage(cfg, run)[0]
    for step in (2, 4):
        key = f"runs/{run}/checkpoints/step-{step:08d}"
        store.write_bytes(f"{key}/.metadata", b"x")
        commit_checkpoint(store, key, {"run_name": run})
    losses = ((1, 5.0), (2, 4.0), (3, float("nan")))
    lines = "".join(json.dumps({"event": "train", "step": s, "loss": v}) + "\n" for s, v in losses)
    store.write_bytes(f"runs/{run}/metrics.jsonl", lines.encode())
    choice = find_latest_valid(store, run)
    assert choice.checkpoint.step == 2
    assert "non-finite training loss at step 3" in choice.skipped[0][1]
    rows = {r["step"]: r for r in list_checkpoint_folders(cfg.storage.root, run)}
    assert rows[2]["valid"] and not rows[4]["valid"] and "step 3" in rows[4]["reason"]
    assert list_runs(cfg.storage.root)[0]["newest_valid_step"] == 2


def _count_host_reads(monkeypatch, reads: list) -> None:
    """Count every way a tensor's value reaches Python (a device tensor gets to the host only
    through one of them)."""
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_guard_adds_no_host_sync_on_non_log_steps(tiny_config, tmp_path, monkeypatch):
    """Under the default policy the guard reads nothing on the host per step: the same steps
    read exactly as often with the guard as with it switched off (on CPU, AdamW itself reads
    its step counter; that is not the guard's). Under skip, the one read per step shows up,
    so the count does see the guard's reads."""
    run = "nosync"
    cfg = tiny_config(run_name=run, launch={"nproc_per_node": 1})
    store, shards = _stage(cfg, run)
    trainer = _trainer(cfg, store, shards, tmp_path)
    guarded, unguarded, skipping = [], [], []
    try:
        trainer.train_step()  # warm up outside the count
        with monkeypatch.context() as m:
            _count_host_reads(m, guarded)
            for _ in range(3):
                trainer.train_step()
        check = trainer.numerics.check_step
        with monkeypatch.context() as m:
            m.setattr(trainer.numerics, "check_step", lambda *a: False)
            _count_host_reads(m, unguarded)
            for _ in range(3):
                trainer.train_step()
        with monkeypatch.context() as m:
            m.setattr(trainer.numerics, "skip_enabled", True)
            _count_host_reads(m, skipping)
            trainer.train_step()
        assert trainer.numerics.check_step == check
        # it still notices: a NaN step (9) is named at the next check
        with torch.no_grad():
            next(trainer.raw_model.parameters()).fill_(float("nan"))
        trainer.train_step()
        with pytest.raises(Exception, match="non-finite loss at step 9"):
            trainer.numerics.raise_if_bad(trainer.step)
    finally:
        trainer.batches.close()
    assert len(guarded) == len(unguarded), (guarded, unguarded)
    assert len(skipping) > len(unguarded) / 3, (skipping, unguarded)


@pytest.mark.parametrize(
    "train,says",
    [
        ({"nonfinite": "explode"}, "train.nonfinite: Input should be 'fail' or 'skip' (got 'explode'); use 'fail'"),
        ({"nonfinite_skip_limit": -1}, "train.nonfinite_skip_limit: must be >= 0 (got -1); a small count"),
    ],
)
def test_a_bad_numerics_policy_is_one_clear_config_error(train, says):
    from stoker.config import load_config
    from stoker.failures import ConfigError
    from tests.conftest import tiny_dict

    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file:///tmp/unused", train=train))
    assert says in str(err.value) and len(err.value.problems) == 1
