"""The simulated two-machine cluster (network namespaces, a bridge, moto_server on the bridge's
address) that tests/launch/test_multinode.py and test_lifeline_gang.py run their agents on.

One cluster per pytest worker (session scope), and the tests that use it are one xdist group
(NETNS_GROUP): namespaces, moto and the shard set are made once, not once per module and
worker. Each node's cache outlives a test; a test that counts what a node fetches gives the
nodes fresh caches (`Cluster.fresh_caches`) and counts from its own start (`log_offset`)."""

from __future__ import annotations

import collections
import itertools
import os
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from stoker.config import load_config
from stoker.launch import make_launcher
from stoker.launch.env import child_env
from stoker.launch.torchrun import NodeSpec, TorchrunLauncher
from stoker.storage.store import Store
from tests.conftest import MotoServer, newest_weights, prepare_shards, run_collecting, tiny_dict
from tests.netutil import NetnsNodes

if TYPE_CHECKING:
    import torch

NETNS_GROUP = "netns-cluster"  # xdist group of every test on the cluster
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

    def fresh_caches(self, folder) -> list[str]:
        """Empty caches for the nodes (under `folder`), for a test that counts their fetches."""
        return [os.path.join(str(folder), f"cache-node-{i}") for i in range(NUM_NODES)]

    def specs(self, caches: list[str] | None = None) -> list[NodeSpec]:
        caches = caches or self.caches
        return [
            NodeSpec(
                prefix=self.nodes.exec_prefix(i),
                address=self.nodes.addresses[i],
                env={"GLOO_SOCKET_IFNAME": self.nodes.ifnames[i], "STOKER_CACHE": caches[i]},
            )
            for i in range(NUM_NODES)
        ]

    def config(
        self,
        run: str,
        nproc: int,
        max_steps: int = MAX_STEPS,
        max_restarts: int = 0,
        nodes_in_config: bool = False,
        caches: list[str] | None = None,
    ):
        """The run's config, pinned in the store: (config, its URL). `nodes_in_config`: the
        nodes (with `caches`, else the cluster's) and the rendezvous port are in launch.nodes /
        launch.rdzv_port."""
        placed = (
            {
                "nodes": [{"prefix": list(s.prefix), "address": s.address, "env": s.env} for s in self.specs(caches)],
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

    def log_offset(self) -> int:
        """Where moto's request log ends now: `gets(since=...)` counts what comes after."""
        return os.path.getsize(self.moto.log_path)

    def gets(self, since: int = 0, until: int | None = None) -> collections.Counter:
        """(client address, path) of every GET moto answered with 200 (between log offsets
        `since` and `until`), counted."""
        pattern = re.compile(r'^(\S+) - - \[[^\]]*\] "GET (/[^ ?]+) HTTP/[\d.]+" 200')
        with open(self.moto.log_path, "rb") as f:
            f.seek(since)
            data = f.read() if until is None else f.read(until - since)
        lines = data.decode(errors="replace").splitlines()
        return collections.Counter(m.groups() for m in map(pattern.match, lines) if m)

    def fetched_once_per_node(self, folder: str, names, since: int = 0, until: int | None = None) -> None:
        """Every file of the folder fetched exactly once from each node's address (between
        log offsets `since` and `until`)."""
        gets = self.gets(since, until)
        bucket, _, prefix = self.root.removeprefix("s3://").partition("/")
        for name in names:
            path = f"/{bucket}/{prefix}/{folder}/{name}"
            assert [gets[(addr, path)] for addr in self.nodes.addresses] == [1] * NUM_NODES, path

    def final_weights(self, run: str) -> dict[str, torch.Tensor]:
        return newest_weights(self.store, run, MAX_STEPS, self.test_cache)


@pytest.fixture(scope="session")
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
