"""The tests' forked rank runner (tests/forked_ranks.py): ranks forked from warm zygotes train
like torchrun's, a failing rank is reported with its reason and takes the others down, a
run past its time is killed, and nothing of a run is left behind."""

import pytest

from tests.conftest import prepare_shards, read_proc, train_losses, wait_for_none
from tests.forked_ranks import run_forked, start_ranks, train_argv


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Two tiny run folders, one of 400 steps (the failures cut it short) and one of 4:
    (the long one's config URL, shard key, store)."""
    from stoker.config import load_config
    from tests.conftest import tiny_dict

    root = "file://" + str(tmp_path_factory.mktemp("forked") / "store")
    cfg = load_config(tiny_dict(root, run_name="forked", train={"max_steps": 400}, checkpoint={"interval_steps": 400}))
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/forked/config.json", cfg.to_json().encode())
    short = load_config(tiny_dict(root, run_name="forked-short", train={"max_steps": 4}))
    store.write_bytes("runs/forked-short/config.json", short.to_json().encode())
    return store.url("runs/forked/config.json"), shards.key, store


def _left(pids):
    """The ranks, and anything in their sessions, still alive (zombies are not)."""
    from tests.conftest import live_processes

    return [p for p in live_processes().values() if p.pid in pids or p.sid in pids]


def test_a_failing_rank_is_reported_and_the_others_are_killed(staged):
    """Rank 0 raises at step 2; rank 1 would wait in its next all-reduce until the collective
    timeout: it is killed at once, the failure names the reason, and no rank is left."""
    url, shards, _ = staged
    ranks = start_ranks(train_argv(url, shards), nproc=2, env={"STOKER_FAULT": "raise:rank=0:step=2"})
    pids = list(ranks.pids)
    try:
        lines = list(ranks.lines(timeout=180))
    finally:
        ranks.close()
    assert ranks.returncode not in (0, None)
    assert ranks.codes[0] == 1 and ranks.codes[1] != 0, ranks.codes  # 1: the traceback; then SIGKILL
    assert "RuntimeError: injected fault" in ranks.tails(), ranks.tails()
    assert any('"event": "failure"' in line for line in lines if line.startswith("[rank0]:")), lines[-5:]
    assert all(read_proc(pid) is None for pid in pids)  # reaped by their zygotes: not even zombies
    assert not wait_for_none(lambda: _left(pids))
    ranks.remove()

    with pytest.raises(AssertionError, match="injected fault"):  # run_ranks' contract
        run_forked(url, shards, env={"STOKER_FAULT": "raise:rank=1:step=1"})


def test_ranks_past_their_timeout_are_killed(staged):
    url, shards, _ = staged
    ranks = start_ranks(train_argv(url, shards), nproc=2, env={"STOKER_FAULT": "hang:rank=1:step=1"})
    pids = list(ranks.pids)
    with pytest.raises(TimeoutError, match="ran past 8 s"):
        for _ in ranks.lines(timeout=8):
            pass
    assert ranks.codes == {0: -9, 1: -9}, ranks.codes
    assert not wait_for_none(lambda: _left(pids))
    ranks.remove()


def test_forked_ranks_train_with_the_numbers_torchrun_gives_them(staged):
    """Each rank says its numbers (a Joined event: torchrun's RANK, GROUP_RANK, LOCAL_RANK and
    error file are there), and the two ranks train and checkpoint a short run together."""
    from stoker.storage.checkpoints import list_checkpoints

    store, shards = staged[2], staged[1]
    records = run_forked(store.url("runs/forked-short/config.json"), shards)
    joined = sorted((r["rank"], r["group_rank"], r["local_rank"]) for r in records if r["event"] == "joined")
    assert joined == [(0, 0, 0), (1, 0, 1)]
    assert sorted(train_losses(records)) == [1, 2, 3, 4]
    assert [r.step for r in list_checkpoints(store, "forked-short")] == [4]
