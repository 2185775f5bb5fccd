"""Two machines, simulated: each node is a torchrun agent (`--nnodes 2 --node-rank i`) in a
network namespace of its own, with its own address on a veth whose other end is on a bridge
the test makes. Rendezvous, gloo traffic and S3 (moto_server, bound to the bridge's address)
cross real interfaces, and each node has its own cache, as separate machines would. The
cluster (tests/launch/conftest.py) is made once per pytest worker; its tests are one xdist group.

- Each node downloads the shard set and the resume checkpoint once for its 2 ranks (moto's
  request log: one GET per file from each node's address), and every later launch on the node
  finds the shards in its cache. This one places the nodes through
  the config (launch.nodes, launch.rdzv_port) and launch.make_launcher, as the flow does; the
  others give `NodeSpec`s in Python.
- Losing a node (every process in its namespace SIGKILLed) makes the other node's ranks fail
  at once (gloo: the peer closed the connection), not hang; the launch fails as transient,
  and a relaunch from the newest valid checkpoint ends bit for bit where an unbroken run of
  the same world size ends. `launch.max_restarts` is 0 there: the relaunch path.
- With `launch.max_restarts: 1`, a rank killed on one node is restarted in place on both
  nodes, in one launch, and the run ends bit for bit like the unbroken one.

The bitwise tests run one rank per node (world size 2): with more ranks, a resumed DDP run
differs from an unbroken one in the last bits whatever the nodes (DDP rebuilds its gradient
buckets after its first step, and the order a ring all-reduce adds more than 2 numbers in
follows the bucket layout; seen on one host with 4 ranks too).
"""

from __future__ import annotations

import os
import time

import pytest

from stoker.contracts import events
from stoker.storage.checkpoints import find_latest_valid, list_checkpoints, validate_checkpoint
from tests.conftest import assert_bitwise_equal, event_losses
from tests.launch.conftest import INTERVAL, MAX_STEPS, NETNS_GROUP

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group(NETNS_GROUP)]


@pytest.fixture(scope="module")
def unbroken(cluster):
    """A 2 x 1 run that nothing interrupts: (its losses, its final weights)."""
    cfg, url = cluster.config("mn-unbroken", nproc=1)
    seen = cluster.completed(cfg, url)
    return event_losses(seen), cluster.final_weights("mn-unbroken")


def test_a_lost_node_fails_the_other_fast_and_the_relaunch_ends_bitwise(cluster, unbroken, tmp_path):
    """Node 1 freezes before step 6 (checkpoint 4 is committed by then), then is lost whole:
    its agent and its rank are SIGKILLed while node 0's rank waits in step 6's all-reduce."""
    whole, whole_weights = unbroken
    run = "mn-lost-node"
    cfg, url = cluster.config(run, nproc=1)
    freeze = {"STOKER_FAULT": "hang:rank=1:step=6", "STOKER_FAULT_ONCE": str(tmp_path / "fired")}
    killed_at: list[float] = []

    def lose_node_1(seen):
        committed = any(isinstance(e, events.CheckpointCommitted) and e.step == INTERVAL for e in seen)
        if not killed_at and committed and any(isinstance(e, events.Train) and e.step == 5 for e in seen):
            time.sleep(1.0)  # node 0 is now in step 6's all-reduce, waiting for node 1
            assert cluster.nodes.kill(1), "node 1 has no process to kill"
            killed_at.append(time.monotonic())

    launcher, first, seen, lines = cluster.launch(cfg, url, env=freeze, on_event=lose_node_1)
    seconds = time.monotonic() - killed_at[0] if killed_at else None
    assert seconds is not None, "node 1 was never killed:\n" + "\n".join(lines[-40:])
    assert seconds < 30, f"the launch took {seconds:.1f}s to end after node 1 was lost"
    print(f"node 1 lost: the launch ended {seconds:.2f}s later")  # shown with pytest -s
    # node 0's rank saw the loss itself (gloo: connection closed) and said so, transient
    assert [(f.rank, f.transient) for f in first.failures] == [(0, True)], (first.failures, lines[-30:])
    assert first.lost_ranks == [1]  # killed: no error file
    error = launcher.classify_end(first)
    assert error is not None and error.transient and error.reason == "lost-rank"
    assert max(event_losses(seen)) == 5

    choice = find_latest_valid(cluster.store, run, {"run_name": run, "model_hash": cfg.model_hash()})
    assert choice.checkpoint is not None and choice.checkpoint.step == INTERVAL
    seen = cluster.completed(cfg, url, resume_key=choice.checkpoint.key, env=freeze)
    assert [e.step for e in seen if isinstance(e, events.Resumed)] == [INTERVAL]
    losses = event_losses(seen)
    assert sorted(losses) == list(range(INTERVAL + 1, MAX_STEPS + 1))
    assert all(losses[s] == whole[s] for s in losses)
    assert_bitwise_equal(whole_weights, cluster.final_weights(run))


def test_a_killed_rank_is_restarted_in_place_on_both_nodes_and_ends_bitwise(cluster, unbroken, tmp_path):
    """launch.max_restarts: 1; node 1's rank SIGKILLs itself before step 6: both agents
    restart their ranks in the same launch, which resume from checkpoint 4 themselves. Node 0's
    agent may restart its ranks as a membership change, which torchrun does not count
    (TORCHELASTIC_RESTART_COUNT 0 there, 1 on node 1): the ranks agree that this is a restart,
    and each rendezvous round has a store of its own (seen hanging in init without both)."""
    whole, whole_weights = unbroken
    run = "mn-restart"
    cfg, url = cluster.config(run, nproc=1, max_restarts=1)
    fault = {"STOKER_FAULT": "kill:rank=1:step=6", "STOKER_FAULT_ONCE": str(tmp_path / "fired")}
    seen = cluster.completed(cfg, url, env=fault)
    assert (tmp_path / "fired").exists()
    assert [e.step for e in seen if isinstance(e, events.Resumed)] == [INTERVAL]
    losses = event_losses(seen)  # steps 5 and on twice: the last report of each counts
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert all(losses[s] == whole[s] for s in losses)
    assert_bitwise_equal(whole_weights, cluster.final_weights(run))


def test_each_node_fetches_the_shards_and_the_resume_checkpoint_once_for_its_ranks(cluster, unbroken, tmp_path):
    """The unbroken run, resumed from its step-4 checkpoint on 2 ranks per node (4 ranks: the
    RNG streams are re-seeded, the weights loaded), with empty node caches: each node's lock
    let one rank read each file, the other reused its copy. Last in this module: every launch
    before it (the unbroken run, the lost node's, the restarts) ran on the nodes' own caches,
    where the shards were fetched once per node and found in the cache by every later launch."""
    before = cluster.log_offset()
    manifest = cluster.store.read_json(f"{cluster.shard_key}/manifest.json")
    cluster.fetched_once_per_node(cluster.shard_key, manifest["files"], until=before)
    run = "mn-unbroken"  # a checkpoint resumes only in its own run
    key = next(r.key for r in list_checkpoints(cluster.store, run) if r.step == INTERVAL)
    files = validate_checkpoint(cluster.store, key).manifest["files"]  # read now: step 5's commit prunes it
    caches = cluster.fresh_caches(tmp_path)
    cfg, url = cluster.config(run, nproc=2, max_steps=INTERVAL + 1, nodes_in_config=True, caches=caches)
    seen = cluster.completed(cfg, url, resume_key=key)
    assert [e.step for e in seen if isinstance(e, events.Resumed)] == [INTERVAL]
    assert sorted(event_losses(seen)) == [INTERVAL + 1]
    cluster.fetched_once_per_node(cluster.shard_key, manifest["files"], since=before)
    cluster.fetched_once_per_node(key, files, since=before)
    for cache in caches:
        assert os.path.isfile(os.path.join(cache, cluster.shard_key, "manifest.json"))
