"""Two machines, simulated: each node is a torchrun agent (`--nnodes 2 --node-rank i`) in a
network namespace of its own, with its own address on a veth whose other end is on a bridge
the test makes. Rendezvous, gloo traffic and S3 (moto_server, bound to the bridge's address)
cross real interfaces, and each node has its own cache, as separate machines would.

- Each node downloads the shard set and the resume checkpoint once for its 2 ranks (moto's
  request log: one GET per file from each node's address). This one places the nodes through
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

import collections
import itertools
import os
import re
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from stoker.core import events
from stoker.core.config import load_config
from stoker.launch import make_launcher
from stoker.launch.env import child_env
from stoker.launch.torchrun import NodeSpec, TorchrunLauncher
from stoker.storage.checkpoints import find_latest_valid, list_checkpoints, validate_checkpoint
from stoker.storage.store import Store
from tests.conftest import (
    MotoServer,
    assert_bitwise_equal,
    event_losses,
    newest_weights,
    prepare_shards,
    run_collecting,
    tiny_dict,
)
from tests.netutil import NetnsNodes

pytestmark = pytest.mark.e2e

NUM_NODES = 2
MAX_STEPS, INTERVAL = 8, 4


@dataclass
class Cluster:
    nodes: NetnsNodes
    moto: MotoServer
    root: str
    options: dict
    caches: list[str]  # each node's STOKER_CACHE
    shard_key: str  # shards/<cache-key>
    ports: "itertools.count[int]"  # rendezvous ports (fresh namespaces: every port is free)
    test_cache: str  # the test's own (its GETs come from the bridge address, no node's)

    @property
    def store(self) -> Store:
        return Store(self.root, self.options)

    def specs(self) -> list[NodeSpec]:
        return [
            NodeSpec(
                prefix=self.nodes.exec_prefix(i),
                address=self.nodes.addresses[i],
                env={"GLOO_SOCKET_IFNAME": self.nodes.ifnames[i], "STOKER_CACHE": self.caches[i]},
            )
            for i in range(NUM_NODES)
        ]

    def config(
        self, run: str, nproc: int, max_steps: int = MAX_STEPS, max_restarts: int = 0, nodes_in_config: bool = False
    ):
        """The run's config, pinned in the store: (config, its URL). `nodes_in_config`: the
        nodes and the rendezvous port are in launch.nodes / launch.rdzv_port."""
        placed = (
            {
                "nodes": [{"prefix": list(s.prefix), "address": s.address, "env": s.env} for s in self.specs()],
                "rdzv_port": next(self.ports),
            }
            if nodes_in_config
            else {}
        )
        cfg = load_config(
            tiny_dict(
                self.root,
                run_name=run,
                train={"max_steps": max_steps},
                checkpoint={"interval_steps": INTERVAL},
                eval={"per_checkpoint_enabled": False},
                storage={"root": self.root, "storage_options": self.options},
                launch={
                    "num_nodes": NUM_NODES,
                    "nproc_per_node": nproc,
                    "timeout_seconds": 240,
                    "rdzv_host": self.nodes.addresses[0],
                    "max_restarts": max_restarts,
                    **placed,
                },
            )
        )
        name = f"runs/{run}/config-{max_steps}.json"
        self.store.write_bytes(name, cfg.to_json().encode())
        return cfg, self.store.url(name)

    def launch(self, cfg, config_url: str, resume_key: str | None = None, env: dict | None = None, on_event=None):
        """One launch attempt across the nodes: (launcher, GangResult, events, output lines)."""
        if cfg.launch.nodes:  # as the flow launches: everything from the config
            launcher = make_launcher(cfg, config_url, self.shard_key, resume_key)
            for node_env in launcher.gang.envs:
                node_env.update(env or {})
        else:
            launcher = TorchrunLauncher(
                cfg,
                config_url,
                self.shard_key,
                resume_key,
                env={**child_env(cfg), **(env or {})},
                nodes=self.specs(),
                rdzv_port=next(self.ports),
            )
        return (launcher, *run_collecting(launcher, on_event))

    def completed(self, cfg, config_url: str, resume_key: str | None = None, env: dict | None = None):
        _, result, seen, lines = self.launch(cfg, config_url, resume_key, env)
        assert result.reason == "completed" and result.returncodes == [0] * NUM_NODES, "\n".join(lines[-40:])
        return seen

    def gets(self) -> collections.Counter:
        """(client address, path) of every GET moto answered with 200, counted."""
        pattern = re.compile(r'^(\S+) - - \[[^\]]*\] "GET (/[^ ?]+) HTTP/[\d.]+" 200')
        with open(self.moto.log_path) as f:
            return collections.Counter(m.groups() for m in map(pattern.match, f) if m)

    def fetched_once_per_node(self, folder: str, names) -> None:
        """Every file of the folder fetched exactly once from each node's address."""
        gets = self.gets()
        bucket, _, prefix = self.root.removeprefix("s3://").partition("/")
        for name in names:
            path = f"/{bucket}/{prefix}/{folder}/{name}"
            assert [gets[(addr, path)] for addr in self.nodes.addresses] == [1] * NUM_NODES, path

    def final_weights(self, run: str) -> dict[str, torch.Tensor]:
        return newest_weights(self.store, run, MAX_STEPS, self.test_cache)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = NetnsNodes.unavailable()
    if why:
        pytest.skip(why)
    nodes = NetnsNodes(NUM_NODES)
    try:
        nodes.up()
    except OSError as err:  # e.g. a container without CAP_NET_ADMIN
        pytest.skip(f"cannot make network namespaces here: {err}")
    tmp = tmp_path_factory.mktemp("multinode")
    moto = MotoServer(host=nodes.bridge_address, log_path=str(tmp / "moto.log"))
    try:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            os.environ.setdefault(k, v)
        moto.start()
        import s3fs

        options = {"endpoint_url": moto.url, "skip_instance_cache": True}
        bucket = f"stoker-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        root = f"s3://{bucket}/root"
        _, shards = prepare_shards(load_config(tiny_dict(root, storage={"root": root, "storage_options": options})))
        yield Cluster(
            nodes,
            moto,
            root,
            options,
            [str(tmp / f"cache-node-{i}") for i in range(NUM_NODES)],
            shards.key,
            itertools.count(29500),
            str(tmp / "cache-test"),
        )
    finally:
        moto.stop()
        nodes.down()
    assert not nodes.leftovers()


@pytest.fixture(scope="module")
def unbroken(cluster):
    """A 2 x 1 run that nothing interrupts: (its losses, its final weights)."""
    cfg, url = cluster.config("mn-unbroken", nproc=1)
    seen = cluster.completed(cfg, url)
    return event_losses(seen), cluster.final_weights("mn-unbroken")


def test_each_node_fetches_the_shards_and_the_resume_checkpoint_once_for_its_ranks(cluster):
    run = "mn-cache"
    cfg, url = cluster.config(run, nproc=2, max_steps=INTERVAL, nodes_in_config=True)
    assert sorted(event_losses(cluster.completed(cfg, url))) == list(range(1, INTERVAL + 1))
    longer, longer_url = cluster.config(run, nproc=2, max_steps=INTERVAL + 1, nodes_in_config=True)
    key = list_checkpoints(cluster.store, run)[0].key
    seen = cluster.completed(longer, longer_url, resume_key=key)
    assert [e.step for e in seen if isinstance(e, events.Resumed)] == [INTERVAL]
    assert sorted(event_losses(seen)) == [INTERVAL + 1]
    # 4 ranks on 2 nodes: each node's lock let one rank read, the other reused its copy; the
    # second launch found the shards in each node's cache
    manifest = cluster.store.read_json(f"{cluster.shard_key}/manifest.json")
    cluster.fetched_once_per_node(cluster.shard_key, manifest["files"])
    cluster.fetched_once_per_node(key, validate_checkpoint(cluster.store, key).manifest["files"])
    for cache in cluster.caches:
        assert os.path.isfile(os.path.join(cache, cluster.shard_key, "manifest.json"))


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
