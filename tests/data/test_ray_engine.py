"""data.engine 'ray' on a real two-node Ray cluster (tests.raycluster, the session's
`ray_cluster`): the driver connects with Ray Client from this namespace, the tasks read the
corpus from and write the shards to S3 (moto on the bridge address both nodes reach). The
shard files and the manifest's entries must be byte-identical to the local engine's. Also a
local Ray instance (ray.address empty), and, without Ray, the engine's ranged reading and
its shard plan against the local engine's."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from stoker.config import DataConfig, RayConfig, TokenizerConfig
from stoker.data import prepare as data_prep
from stoker.data import ray_engine, sharding
from stoker.failures import ConfigError, DataError
from stoker.storage.datasets import dataset_parts
from stoker.storage.shards import validate_shard_set
from stoker.storage.store import Store, join

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'stoker[ray]')"
)

PARTITION_BYTES = 50_000  # 6 partitions of the ~300 KB corpus
DATA = dict(max_bytes=300_000, val_fraction=0.1, shard_tokens=16_384)


def _prepared(store: Store, **data):
    cfg = DataConfig(**{**DATA, **data})
    ds = data_prep.download_dataset(cfg, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=384), store)
    return cfg, ds, tk


def _shard_set(store: Store, shards) -> tuple[dict, dict[str, bytes]]:
    """(manifest, {file name: bytes}) of a published shard set, read back from the store."""
    manifest = store.read_json(join(shards.key, "manifest.json"))
    return manifest, {name: store.read_bytes(join(shards.key, name)) for name in manifest["files"]}


def _build(store, ds, tk, cfg, engine: str, ray: RayConfig | None = None):
    """A fresh shard set of `engine` (any earlier one removed first)."""
    store.rm("shards")
    return data_prep.tokenize_and_shard(
        ds, tk, cfg.model_copy(update={"engine": engine}), store, partition_bytes=PARTITION_BYTES, ray=ray
    )


@pytest.fixture(autouse=True)
def _no_ray_connection_left():
    """Each build connects and disconnects; a connection left behind is a failure here, and is
    closed so that it cannot fail the next test too."""
    yield
    ray = sys.modules.get("ray")  # never imported: never connected
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("the Ray engine left this process connected to Ray")


def _ray_nodes(caplog) -> set[str]:
    return {n for r in caplog.records if hasattr(r, "ray_nodes") for n in r.ray_nodes}


# ---- without Ray: the engine's own reading and cutting ---------------------------------------
def test_ranged_reads_of_the_store_give_each_partition_the_lines_the_local_engine_gives(tmp_path):
    docs = [f"doc {i} " + "é" * (i % 23) for i in range(200)]
    body = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()
    (tmp_path / "c.jsonl").write_bytes(body)
    store = Store(f"memory://stoker-ranges-{tmp_path.name}")
    store.write_bytes("c.jsonl", body)

    def read(offset, size):
        return store.read_range("c.jsonl", offset, min(size, len(body) - offset)) if offset < len(body) else b""

    for step in (1, 5, 333, 4096, len(body) + 1):
        for start, end in sharding.partition_ranges(len(body), step):
            here = list(sharding._partition_docs(str(tmp_path / "c.jsonl"), start, end))
            ranged = [sharding.corpus_text(line, off) for off, line in sharding.range_lines(read, start, end, chunk=7)]
            assert ranged == here, (step, start)


def test_the_ray_plan_cuts_and_numbers_shards_as_the_local_assembler_does(tmp_path):
    rng = np.random.default_rng(0)
    pieces = []
    for k in range(7):  # partitions of 0 to 40 documents of 1 to 300 tokens
        lengths = rng.integers(1, 300, size=rng.integers(0, 40))
        tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype("<u2")
        bin_path, idx_path = tmp_path / f"p{k}.bin", tmp_path / f"p{k}.idx"
        bin_path.write_bytes(tokens.tobytes())
        idx_path.write_bytes(np.cumsum(lengths).astype("<u8").tobytes())
        pieces.append((str(bin_path), str(idx_path), tokens))
    out = tmp_path / "local"
    out.mkdir()
    assembler = sharding._ShardAssembler(str(out), "train", np.dtype("<u2"), 1024, lambda name, path: None)
    planner = ray_engine._ShardPlanner("train", 1024)
    plans = []
    for k, (bin_path, idx_path, _) in enumerate(pieces):
        assembler.add(bin_path, idx_path)
        plans += planner.add(str(k), np.fromfile(idx_path, dtype="<u8"))
    assembler.close()
    plans.append(planner.close())
    assert len(plans) == len(assembler.files) // 2 >= 5
    for plan in plans:
        data = b"".join(pieces[int(key)][2][first:end].tobytes() for key, first, end in plan.runs)
        name = sharding.shard_name("train", plan.index, "bin")
        assert (out / name).read_bytes() == data and assembler.files[name]["tokens"] == plan.tokens
        assert (out / name.replace(".bin", ".idx")).read_bytes() == plan.idx.tobytes()


# ---- on Ray ------------------------------------------------------------------------------
@pytest.fixture
def cluster_bucket(ray_cluster):
    """A fresh bucket that every node of the Ray cluster reaches, with the corpus and the
    tokenizer prepared in it: (root, options, store, cfg, ds, tk)."""
    root, options = ray_cluster.bucket()
    store = Store(root, options)
    return (root, options, store, *_prepared(store))


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
def test_ray_engine_shards_match_the_local_engine_byte_for_byte_and_use_both_nodes(ray_cluster, cluster_bucket, caplog):
    root, options, store, cfg, ds, tk = cluster_bucket
    local = _build(store, ds, tk, cfg, "local")
    local_manifest, local_files = _shard_set(store, local)
    assert len(local_manifest["splits"]["train"]) >= 3  # several shard files, cut in several places

    with caplog.at_level(logging.INFO, logger="stoker.data"):
        remote = _build(store, ds, tk, cfg, "ray", RayConfig(address=ray_cluster.cluster.client_address))
    assert not remote.cache_hit and remote.cache_key == local.cache_key  # the engine is not in the key
    manifest, files = _shard_set(Store(root, options), remote)
    assert manifest["files"] == local_manifest["files"]
    assert {k: v for k, v in manifest.items() if k != "files"} == {
        k: v for k, v in local_manifest.items() if k != "files"
    }
    assert files.keys() == local_files.keys() and all(files[n] == local_files[n] for n in files)
    assert validate_shard_set(store, remote.cache_key, deep=True)
    assert len(_ray_nodes(caplog)) == 2  # tasks ran on the head and on the worker node
    assert store.listdir("shards") == [remote.cache_key]  # no staging, no pieces left


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
def test_a_damaged_corpus_fails_both_engines_with_the_same_data_error_and_leaves_nothing(
    ray_cluster, cluster_bucket, monkeypatch
):
    monkeypatch.setattr(data_prep, "SAMPLE_BYTES", 20_000)  # the disk estimate's sample stops before it
    root, options, store, cfg, ds, tk = cluster_bucket
    (part,) = dataset_parts(store, ds.fingerprint)
    key = part.key
    lines = store.read_bytes(key).splitlines(keepends=True)
    bad = len(lines) * 2 // 3  # a line in a later partition, not the first one
    broken = b'{"text": "broken \xff\xfe bytes"}'  # at the line's size: the part is still listed whole
    lines[bad] = broken + b" " * (len(lines[bad]) - len(broken) - 1) + b"\n"
    store.write_bytes(key, b"".join(lines))

    errors = {}
    for engine, ray in (("local", None), ("ray", RayConfig(address=ray_cluster.cluster.client_address))):
        with pytest.raises(DataError) as err:
            _build(store, ds, tk, cfg, engine, ray)
        errors[engine] = str(err.value)
        fresh = Store(root, options)
        assert fresh.walk_files("shards") == {}, engine  # no staging, no pieces, no manifest
    assert errors["ray"] == errors["local"]
    offset = sum(len(line) for line in lines[:bad])
    assert f"line at byte {offset} is not a JSON object" in errors["ray"] and "\n" not in errors["ray"]


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
def test_an_interrupted_build_cancels_its_tasks_disconnects_and_leaves_nothing(
    ray_cluster, cluster_bucket, monkeypatch
):
    root, options, store, cfg, ds, tk = cluster_bucket
    results = []
    real = ray_engine.result_of

    def interrupted_after_the_first(ray, ref, what):
        results.append(real(ray, ref, what))
        if len(results) == 2:  # Ctrl-C while the other partitions are queued or running
            raise KeyboardInterrupt
        return results[-1]

    monkeypatch.setattr(ray_engine, "result_of", interrupted_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        _build(store, ds, tk, cfg, "ray", RayConfig(address=ray_cluster.cluster.client_address))
    time.sleep(2)  # a task still running would have written by now
    assert Store(root, options).walk_files("shards") == {}  # cancelled, waited for, staging removed


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
def test_a_store_the_nodes_cannot_reach_is_a_config_error(ray_cluster, tmp_path):
    store = Store(f"memory://stoker-ray-{tmp_path.name}")  # this process's memory: no node sees it
    cfg, ds, tk = _prepared(store, max_bytes=60_000)
    with pytest.raises(ConfigError, match="every node must reach storage.root"):
        _build(store, ds, tk, cfg, "ray", RayConfig(address=ray_cluster.cluster.client_address))
    assert store.walk_files("shards") == {}


DRIVERS_ON_A_NODE = """
import json, logging, sys
from stoker.config import RayConfig
from stoker.storage.store import Store
from tests.data.test_ray_engine import _build, _prepared
how = None
class Nodes(logging.Handler):  # the nodes the engine's tasks ran on
    def emit(self, record):
        if hasattr(record, "ray_nodes"):
            print("NODES", how, len(set(record.ray_nodes)), flush=True)
logging.getLogger("stoker.data").setLevel(logging.INFO)
logging.getLogger("stoker.data").addHandler(Nodes())
for how, root, options, address in json.loads(sys.argv[1]):  # one build after the other
    store = Store(root, options)
    cfg, ds, tk = _prepared(store)  # cache hits: the test made them
    print("SHARDS", how, _build(store, ds, tk, cfg, "ray", RayConfig(address=address)).cache_key, flush=True)
"""
HOWS = ("HOST:PORT", "auto")


@pytest.fixture(scope="module")
def drivers_on_a_node(ray_cluster, tmp_path_factory):
    """One process on the head node, as a flow run on a cluster node: it builds a shard set by
    each ray.address form in turn, each into a bucket of its own (prepared here, with the local
    engine's shard set built in the first): (its output, the local build, its manifest and
    files, {form: the store it built into})."""
    cluster = ray_cluster.cluster
    stores, builds = {}, []
    for how in HOWS:
        root, options = ray_cluster.bucket()
        stores[how] = store = Store(root, options)
        cfg, ds, tk = _prepared(store)
        builds.append((how, root, options, cluster.gcs_address if how == "HOST:PORT" else "auto"))
        if how == HOWS[0]:
            local = _build(store, ds, tk, cfg, "local")
            local_manifest, local_files = _shard_set(store, local)
            store.rm("shards")
    work = tmp_path_factory.mktemp("drivers")
    script = work / "driver.py"
    script.write_text(DRIVERS_ON_A_NODE)
    out = subprocess.run(
        [*cluster.exec_prefix(0), sys.executable, str(script), json.dumps(builds)],
        env=cluster.node_env(0),
        cwd=str(work),
        capture_output=True,
        text=True,
        timeout=360,
    )
    return out, local, local_manifest, local_files, stores


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
@pytest.mark.parametrize("how", HOWS)
def test_a_driver_on_a_node_joins_by_gcs_address_or_auto_with_the_same_bytes(ray_cluster, drivers_on_a_node, how):
    """A flow run on a cluster node (no Ray Client): ray.address is the head's GCS HOST:PORT, or
    'auto', which finds the cluster this node runs. The shards equal the local engine's."""
    out, local, local_manifest, local_files, stores = drivers_on_a_node
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"SHARDS {how} {local.cache_key}" in out.stdout
    assert f"NODES {how} 2" in out.stdout.splitlines(), out.stdout[-2000:]  # the cluster's two nodes
    store = stores[how]
    manifest, files = _shard_set(store, local)
    assert manifest == local_manifest and files == local_files
    assert store.listdir("shards") == [local.cache_key]  # no staging, no pieces left


@pytest.mark.e2e  # a Ray instance or the two-node cluster: not in the quick subset
@needs_ray
@pytest.mark.ray_instance  # with the Ray cluster's tests: one Ray on this machine at a time
def test_an_empty_ray_address_runs_a_local_ray_instance_with_the_same_bytes(tmp_path, caplog):
    store = Store(f"file://{tmp_path}/store")
    cfg, ds, tk = _prepared(store, max_bytes=100_000)
    local = _build(store, ds, tk, cfg, "local")
    local_manifest, local_files = _shard_set(store, local)
    niceness = os.environ.get("RAY_worker_niceness")
    with caplog.at_level(logging.INFO, logger="stoker.data"):
        remote = _build(store, ds, tk, cfg, "ray", RayConfig())
    manifest, files = _shard_set(store, remote)
    assert manifest["files"] == local_manifest["files"] and files == local_files
    assert len(_ray_nodes(caplog)) == 1
    # the local Ray's workers ran at nice 0 (process.ray_connect.start_local), and that setting
    # was for its start only: this process's environment is as it was
    assert os.environ.get("RAY_worker_niceness") == niceness
