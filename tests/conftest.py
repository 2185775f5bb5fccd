"""Shared fixtures: a session-wide Prefect test server, a real S3 endpoint (moto_server on
127.0.0.1), tiny configs and a prepared tiny shard set."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import pytest

# Prefect reads its settings at import: set them before any test module imports it. A child
# process that imports this module (a test's script) removes its own home when it exits.
_PREFECT_HOME = tempfile.mkdtemp(prefix="stoker-prefect-home-")
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ.update(
    {
        "PREFECT_HOME": _PREFECT_HOME,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "INFO",
        # every Prefect server of the tests (the harness's, PrefectServer's, a `stoker run`'s
        # temporary one) stores its events every second, not every 5 s: a test that reads an
        # event back (stoker_events) waits for that flush
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "STOKER_CACHE": os.path.join(_PREFECT_HOME, "cache"),
        # one torch/OpenMP thread where nothing else says (evaluations, in-process tensors): two
        # xdist workers already keep both cores busy, and a 2-thread process on a busy 2-core
        # machine spins for its partner thread (an evaluation took 2x the CPU). The ranks keep
        # the launcher's rule (training.distributed: the cores divided among the local ranks).
        "OMP_NUM_THREADS": "1",
    }
)
os.environ.pop("PREFECT_API_URL", None)

# the folder of the run's migrated Prefect database (migrated_prefect_db): made by the first
# process that imports this module (under xdist: the controller, before it starts the workers,
# which inherit the variable) and removed when that process exits
_MIGRATED_DB_ENV = "STOKER_TEST_PREFECT_DB_DIR"
if not os.environ.get(_MIGRATED_DB_ENV):
    os.environ[_MIGRATED_DB_ENV] = tempfile.mkdtemp(prefix="stoker-prefect-db-")
    atexit.register(shutil.rmtree, os.environ[_MIGRATED_DB_ENV], ignore_errors=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# tryfirst: before xdist's own hook, which reads the groups into the node ids (after it, the
# marks were ignored and each worker started a Ray cluster of its own)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) every test on the
    session's Ray cluster, and every test marked `ray_instance` (it starts a Ray of its own),
    runs on one worker: one cluster is started, not one per worker, and there is one Ray on
    the machine at a time (ray.address 'auto' finds a cluster by its processes). Every other
    test that uses a module-scoped fixture (a module's run, built once for its tests) runs on
    its module's worker, unless it names a group of its own: dealt out test by test, each
    worker would build the module's run again."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray_instance"):
            item.add_marker(pytest.mark.xdist_group("ray-cluster"))
        elif not item.get_closest_marker("xdist_group") and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None or getattr(item, "module", None) is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())


def pytest_sessionfinish(session, exitstatus):
    from tests.forked_ranks import stop_zygotes

    stop_zygotes()  # this worker's warm rank zygotes, if it started any
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


def migrated_prefect_db() -> str:
    """A Prefect database file at this Prefect's schema, made once per test run (all xdist
    workers share it): a server that starts on a copy skips the migrations of a new database
    (~4 of its ~12 CPU-s to become healthy). Nothing else is in it; a server registers its
    block types on start as on any database."""
    path = os.path.join(os.environ[_MIGRATED_DB_ENV], "prefect.db")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds it; the others wait for it
        if not os.path.exists(path):
            building = path + ".new"
            out = subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env={**os.environ, "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{building}"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            for leftover in (building + "-wal", building + "-shm"):  # none after a clean exit
                assert not os.path.exists(leftover), leftover
            os.replace(building, path)
    return path


def seeded_prefect_home(home) -> str:
    """`home` (made if missing) as a PREFECT_HOME whose database is already migrated (see
    migrated_prefect_db): for a `stoker` process whose temporary server is a test's subject."""
    os.makedirs(home, exist_ok=True)
    shutil.copyfile(migrated_prefect_db(), os.path.join(home, "prefect.db"))
    return str(home)


@pytest.fixture(scope="session")
def prefect_server():
    """One real Prefect server (prefect_test_harness) for the whole session, on a copy of the
    migrated database (the harness's own temporary folder, with the copy in it)."""
    import prefect.testing.utilities as harness

    migrated = migrated_prefect_db()

    def seeded_folder() -> str:  # what the harness names its database in: prefect-test.db
        folder = tempfile.mkdtemp(prefix="stoker-prefect-test-")
        shutil.copyfile(migrated, os.path.join(folder, "prefect-test.db"))
        return folder

    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(harness, "mkdtemp", seeded_folder)  # called once, as the harness starts
            stack.enter_context(harness.prefect_test_harness(server_startup_timeout=120))
        yield


@pytest.fixture
def session_server_env(prefect_server) -> dict:
    """The environment for a `stoker` process that runs its flow on the session's Prefect
    server (no temporary server of its own: 30-45 s saved where that is not the subject)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- a real `prefect server start` and the processes a test starts around it -----------
def start_process(cmd: list[str], env: dict, log) -> subprocess.Popen:
    """`cmd` from the repo root in a session of its own (so stop_process ends all of it),
    stdout and stderr to the open file `log`."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stoker_deploy(env: dict) -> str:
    """`stoker deploy` on the server `env` names; assert it succeeded; its standard output."""
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "deploy"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def start_worker(env: dict, log_path) -> subprocess.Popen:
    """A Prefect process worker on stoker's work pool (what `stoker deploy` made), asking for
    runs every second; its output goes to `log_path`."""
    with open(log_path, "w") as log:
        return start_process(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "stoker-process", "--prefetch-seconds", "5"],
            {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"},
            log,
        )


def stop_worker(proc: subprocess.Popen) -> None:
    """Stop a Prefect worker (start_worker) once its runs have ended, with a 3 s grace: `prefect
    worker start` (3.9.1) sometimes answers SIGTERM with "Sending SIGINT to the process worker"
    and is still running 20 s later (a full `.ci/run`: the deployments module's teardown waited
    out the whole grace; run alone, the same worker stopped within a second)."""
    stop_process(proc, grace=3)


def stop_process(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def wait_for(what: str, check, seconds: float, logs=()):
    """Poll `check()` every second until it returns something truthy (returned); fail with
    the tails of `logs` after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    tails = "\n".join(f"--- {p}:\n" + open(p).read()[-4000:] for p in logs if os.path.exists(p))
    pytest.fail(f"gave up waiting for {what}\n{tails}")


class PrefectServer:
    """A real `prefect server start` on 127.0.0.1 with a fixed port and home, so it can be
    stopped and started again with its database (the outage a restart or a network cut
    makes); its scheduler looks for due runs every 2 s, its proactive triggers are evaluated
    every second. `env`: the environment for processes that talk to it."""

    def __init__(self, home: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = os.path.join(home, "server.log")
        self.env = {
            **os.environ,
            "PREFECT_HOME": seeded_prefect_home(os.path.join(home, "prefect-home")),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
            # proactive triggers (a stalled-run automation: "no step event within N s") looked at
            # every second, not every 5 s
            "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S",
            "PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true",  # what a 503 was, in server.log
            "PREFECT_API_URL": self.url,
        }
        self.proc: subprocess.Popen | None = None

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.proc = start_process(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                self.env,
                out,
            )
        wait_for("the Prefect server", self.healthy, 180, [self.log])

    def stop(self) -> None:
        stop_process(self.proc)
        wait_for("the Prefect server to go away", lambda: not self.healthy(), 30)


@contextmanager
def real_prefect_server(home: str):
    """A real `prefect server start` (PrefectServer) for the block; yields its environment."""
    server = PrefectServer(home)
    try:
        server.start()
        yield server.env
    finally:
        if server.proc is not None:
            stop_process(server.proc)


@pytest.fixture
def prefect_api(tmp_path):
    """A real `prefect server start` of this test alone (its database starts empty)."""
    with real_prefect_server(str(tmp_path)) as env:
        yield env


@pytest.fixture(scope="session")
def restartable_prefect_server(tmp_path_factory):
    """One PrefectServer (a test may stop and start it) for the session's tests (per xdist
    worker) that name their runs apart and add no deployments or automations to it: the
    modules that use it are one xdist group, so `make test` starts it once (a start costs
    ~10 CPU seconds)."""
    server = PrefectServer(str(tmp_path_factory.mktemp("restartable-prefect")))
    try:
        server.start()
        yield server
    finally:
        if server.proc is not None:
            stop_process(server.proc)


class MotoServer:
    """A real S3 endpoint over HTTP on 127.0.0.1 (or `host`) that a test can stop and restart.
    With `log_path`, its request log (client address, method, path, status) goes there. With
    `keyed`, it can be made to check keys and signatures (`require_keys`)."""

    def __init__(self, host: str = "127.0.0.1", log_path: str | None = None, keyed: bool = False):
        self.host, self.log_path, self.keyed = host, log_path, keyed
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        cmd = [sys.executable, "-m", "tests.keyed_moto"] if self.keyed else [exe]
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [*cmd, "-H", self.host, "-p", str(self.port)], cwd=ROOT, stdout=log, stderr=log, start_new_session=True
            )
        finally:
            if self.log_path:
                log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            self.proc = None

    def require_keys(self) -> tuple[str, str]:
        """From now on this endpoint answers only requests signed with the key pair returned
        here (an IAM user's, allowed s3:*): any other key, the tests' "testing" ones included,
        or a wrong secret gets 403. The pair exists nowhere but in the return value."""
        assert self.keyed, "MotoServer(keyed=True) checks signatures as S3 clients make them"
        import urllib.request

        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        user = "stoker-" + os.urandom(4).hex()
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="s3",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
            ),
        )
        key = iam.create_access_key(UserName=user)["AccessKey"]
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.load(answer)["status"] == "ok"
        return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture(scope="session")
def s3_server():
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server):
    """A fresh bucket on the S3 endpoint: (root URL, storage options)."""
    import uuid

    import s3fs

    bucket = f"stoker-{uuid.uuid4().hex[:12]}"
    options = {"endpoint_url": s3_server.url, "skip_instance_cache": True}
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/root", options


class RayClusterWithStore:
    """A two-node Ray cluster (tests.raycluster) and S3 endpoints every node reaches: one that
    takes any key (the nodes' environment holds the tests' "testing" pair), and, started on
    first use, one that takes only a key pair the nodes do not have."""

    def __init__(self, cluster, moto: MotoServer):
        self.cluster, self.moto = cluster, moto
        self.keyed_moto: MotoServer | None = None
        self._keys: tuple[str, str] | None = None

    def bucket(self) -> tuple[str, dict]:
        """A fresh bucket: (root URL, storage options)."""
        return _fresh_bucket(self.moto.url)

    def keyed_bucket(self) -> tuple[str, dict, tuple[str, str]]:
        """A fresh bucket on the endpoint that refuses every key but one:
        (root URL, storage options, (key id, secret))."""
        if self.keyed_moto is None:
            self.keyed_moto = MotoServer(host=self.cluster.bridge_address, keyed=True)
            self.keyed_moto.start()
            self._keys = self.keyed_moto.require_keys()
        root, options = _fresh_bucket(self.keyed_moto.url, self._keys)
        return root, options, self._keys

    def stop(self) -> None:
        self.moto.stop()
        if self.keyed_moto is not None:
            self.keyed_moto.stop()


def _fresh_bucket(url: str, keys: tuple[str, str] | None = None) -> tuple[str, dict]:
    import uuid

    import s3fs

    bucket = f"stoker-{uuid.uuid4().hex[:12]}"
    options = {"endpoint_url": url, "skip_instance_cache": True}
    signed = {"key": keys[0], "secret": keys[1]} if keys else {}
    s3fs.S3FileSystem(**options, **signed).mkdir(bucket)
    return f"s3://{bucket}/root", options


@pytest.fixture(scope="session")
def ray_cluster():
    """One real Ray cluster for the session: a head and a worker node, one CPU each, each in a
    network namespace of its own, and moto on the bridge address both reach. Skipped where
    namespaces or Ray are not available."""
    from tests.raycluster import RayCluster, ray_unavailable

    why = ray_unavailable()
    if why:
        pytest.skip(why)
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    # in /tmp/stoker-ray-<tag>: Ray's socket paths under its temp folder must stay short
    cluster = RayCluster(num_nodes=2, cpus_per_node=1).up()
    with_store = RayClusterWithStore(cluster, MotoServer(host=cluster.bridge_address))
    try:
        with_store.moto.start()
        yield with_store
    finally:
        with_store.stop()
        cluster.down()


def tiny_dict(root: str, **sections) -> dict:
    """The smallest config that still trains: ~300 KB of stdlib text, a 2-layer GPT, no
    per-checkpoint evaluation (eval={"per_checkpoint_enabled": True} where it is the subject)."""
    base = {
        "storage": {"root": root},
        "data": {"max_bytes": 300_000, "val_fraction": 0.1},
        "tokenizer": {"vocab_size": 384},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "train": {
            "max_steps": 8,
            "warmup_steps": 2,
            "log_interval": 1,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "min_lr": 1e-3,
        },
        "checkpoint": {"interval_steps": 4},
        # per-checkpoint evaluation (a process each) only where a test is about it
        "eval": {"interval_steps": 4, "num_batches": 2, "per_checkpoint_enabled": False},
        "launch": {"nproc_per_node": 2, "timeout_seconds": 300, "max_attempts": 1},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(section, {}).update(values)
        else:
            base[section] = values
    return base


def tiny_sets(**sections) -> list[str]:
    """tiny_dict's fields (storage.root left to the caller) as `stoker run` arguments:
    ["--set", "data.max_bytes=300000", ...]; `sections` as in tiny_dict."""
    import json

    out = []
    for section, values in tiny_dict("", **sections).items():
        if section == "storage":
            continue
        for key, value in values.items():
            out += ["--set", f"{section}.{key}={json.dumps(value)}"]
    return out


@pytest.fixture
def tiny_config(tmp_path):
    from stoker.config import load_config

    def make(**sections):
        return load_config(tiny_dict("file://" + str(tmp_path / "store"), **sections))

    return make


def prepare_shards(cfg):
    """Run the data stage with the plain functions (no Prefect); return (store, DataShards)."""
    from stoker.data import prepare as data_prep
    from stoker.storage.store import Store

    store = Store(cfg.storage.root, cfg.storage.storage_options)
    return store, data_prep.prepare_all(cfg.data, cfg.tokenizer, store, run=cfg.resolved_run_name())


# ---- process scans (Linux /proc), for tests that check nothing of a run is left --------
class Proc:
    """One live process as /proc shows it; `start` (clock ticks after boot) tells a reused
    pid from the process once recorded under it."""

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int, start: int, cmdline: str):
        self.pid, self.ppid, self.pgid, self.sid, self.start, self.cmdline = pid, ppid, pgid, sid, start, cmdline

    def __repr__(self) -> str:
        return f"Proc(pid={self.pid}, pgid={self.pgid}, sid={self.sid}, {self.cmdline[:160]!r})"


def read_proc(pid: int) -> Proc | None:
    """The process, or None when it is gone or a zombie (it has exited; only not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    if fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), cmdline)


def live_processes() -> dict[int, Proc]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                out[proc.pid] = proc
    return out


def gang_members(gang_id: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries this STOKER_GANG_ID."""
    needle, out = f"STOKER_GANG_ID={gang_id}".encode(), []
    for pid in live_processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(pid)
        except OSError:
            continue
    return out


def task_states(flow_state, expect, seconds: float = 60) -> dict[str, str]:
    """{task run name: state name} of the flow run behind a flow's returned state, once every
    name in `expect` is there with a final state. A task run's creation and its states reach
    the server's database as events, a little after the flow returns, so a read made at once
    can miss a run or see it without a state. Names: 'tokenize_and_shard[web]' for a mapped
    task, else the task's name without Prefect's suffix ('train_tokenizer')."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = flow_state.state_details.flow_run_id

    def read():
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        if any(r.state is None or not r.state.is_final() for r in runs):
            return None
        states = {(r.name if "[" in r.name else r.name.rsplit("-", 1)[0]): r.state.name for r in runs}
        return states if set(expect) <= set(states) else None

    return wait_for(f"the task runs {sorted(expect)} in final states", read, seconds)


def wait_for_flow_run(client, flow_run_id, what: str, logs=(), seconds: float = 420):
    """Poll the flow run through `client` (a sync Prefect client) until its state is final;
    the flow run. Fails as wait_for does, with the tails of `logs`."""

    def final():
        run = client.read_flow_run(flow_run_id)
        return run if run.state.is_final() else None

    return wait_for(what, final, seconds, logs)


def stoker_events(env: dict, prefix: str, run: str) -> list[dict]:
    """The events, oldest first, of the server `env` names (PREFECT_API_URL) whose name starts
    with `prefix` and that name the stoker run `run`."""
    import httpx

    from stoker.observe import prefect_events as pe

    body = {"filter": {"event": {"prefix": [prefix]}, "any_resource": {"labels": {pe.RUN_LABEL: [run]}}}, "limit": 50}
    page = httpx.post(env["PREFECT_API_URL"] + "/events/filter", json=body, timeout=30).json()
    return sorted(page["events"], key=lambda e: e["occurred"])


def wait_for_none(left, seconds: float = 15.0, interval: float = 0.1) -> list:
    """Poll left() (what is still there) until it is empty or `seconds` pass; returns its last
    answer. A killed process takes a moment to exit and its parent a moment to reap it (a
    zombie, which read_proc already skips), so a check made once, right after a kill, can see
    a process that is on its way out."""
    deadline = time.monotonic() + seconds
    while True:
        found = left()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(interval)


def descendants(root: int, procs: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """Every live process below `root` in the parent tree (not `root` itself)."""
    procs = live_processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = procs[pid]
            todo.extend(children.get(pid, []))
    return out


class GangWatch:
    """Records the processes of one training run while it runs (call `record()` often): every
    process whose command line names the run's config (torchrun agents, ranks, evaluations)
    and everything below them. `leftovers()` then lists what is left: a recorded process
    still alive (same pid and start time), anything in a recorded process group or session,
    anything naming the config."""

    def __init__(self, marker: str):
        self.marker = marker
        self.seen: dict[int, Proc] = {}

    def record(self, *_args) -> None:
        procs = live_processes()
        for proc in procs.values():
            if self.marker in proc.cmdline:
                self._note(proc)
        for pid in list(self.seen):
            for child in descendants(pid, procs).values():
                self._note(child)

    def _note(self, proc: Proc) -> None:
        """Keep the newest view of a process (same pid and start time): one first seen between
        fork and exec has its parent's command line (a rank then looked like its torchrun
        agent for good, under load). A pid reused by another process keeps the first entry."""
        was = self.seen.get(proc.pid)
        if was is None or was.start == proc.start:
            self.seen[proc.pid] = proc

    def groups(self) -> set[int]:
        """Process groups and sessions of the run (never the test's own)."""
        ids = {p.pgid for p in self.seen.values()} | {p.sid for p in self.seen.values()}
        return ids - {os.getpgid(0), os.getsid(0)}

    def leftovers(self) -> list[Proc]:
        groups, left = self.groups(), []
        for proc in live_processes().values():
            was = self.seen.get(proc.pid)
            if (
                (was is not None and was.start == proc.start)
                or proc.pgid in groups
                or proc.sid in groups
                or self.marker in proc.cmdline
            ):
                left.append(proc)
        return left

    def gone_within(self, seconds: float = 15.0) -> list[Proc]:
        """leftovers(), polled until none is left or `seconds` pass (see wait_for_none)."""
        return wait_for_none(self.leftovers, seconds)


class FlakyHTTPServer:
    """Serves the files of a folder over real HTTP on 127.0.0.1, with ETag headers. It answers
    503 to its first `fail_first` requests (only `fail_method` ones when set), and logs every
    request as (method, path, status)."""

    def __init__(self, folder: str):
        import hashlib
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.folder, self.fail_first, self.fail_method, self.etag = folder, 0, None, True
        self.log: list[tuple[str, str, int]] = []
        lock, server = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: bool) -> None:
                path = os.path.join(server.folder, self.path.split("?", 1)[0].lstrip("/"))
                with lock:
                    failing = server.fail_first > 0 and server.fail_method in (None, self.command)
                    if failing:
                        server.fail_first -= 1
                    status = 503 if failing else 200 if os.path.isfile(path) else 404
                    server.log.append((self.command, self.path, status))
                if status != 200:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with open(path, "rb") as f:
                    data = f.read()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                if server.etag:
                    self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest()[:16])
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def requests(self, method: str | None = None) -> list[tuple[str, str, int]]:
        return [r for r in self.log if method in (None, r[0])]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def http_server(tmp_path):
    """A FlakyHTTPServer on 127.0.0.1 serving tmp_path/'www'; stopped after the test."""
    folder = tmp_path / "www"
    folder.mkdir()
    server = FlakyHTTPServer(str(folder))
    yield server
    server.stop()


@pytest.fixture
def quick_relaunch(monkeypatch):
    """The flow's next launch attempt after ~1 s, not launch_training's 5 s retry delay (a
    fixed wait, with Prefect's jitter of up to half of it either way), for a test that runs
    train_pipeline in its own process and whose subject is the relaunch, not its delay."""
    from stoker.tasks import training

    monkeypatch.setattr(training.launch_training, "retry_delay_seconds", 1)


@pytest.fixture
def fast_retries(monkeypatch):
    """In-task download retries without the real backoff delays (same attempt count)."""
    from stoker.data import sources

    monkeypatch.setattr(sources, "RETRY_BASE_DELAY", 0.01)
    monkeypatch.setattr(sources, "RETRY_MAX_DELAY", 0.05)


# ---- real torchrun ranks, without the orchestrator --------------------------------------
def run_ranks(
    config_url: str,
    shard_key: str,
    resume: str | None = None,
    nproc: int = 2,
    timeout: int = 240,
    cache_dir: str | None = None,
    max_restarts: int = 0,
    env: dict | None = None,
) -> list[dict]:
    """torchrun `nproc` ranks of training.train on this host; assert they succeed and return
    their events (decoded metric lines)."""
    from stoker.launch.torchrun import AGENT
    from stoker.launch.torchrun import free_port as rdzv_port
    from tests.forked_ranks import train_argv  # the ranks' arguments, as the forked runner gives them

    cmd = [
        *AGENT,
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{rdzv_port()}",
        "--tee=3",
        f"--max-restarts={max_restarts}",
        "-m",
        "stoker.training.train",
        *train_argv(config_url, shard_key, resume, cache_dir),
    ]
    out = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [
        json.loads(line.split("STOKER_METRIC ", 1)[1]) for line in out.stdout.splitlines() if "STOKER_METRIC " in line
    ]


def run_collecting(launcher, on_event=None):
    """Run one launch attempt to its end: (GangResult, its events, its output lines).
    `on_event(events so far)` sees each event as it arrives."""
    seen, lines = [], []

    def event(e):
        seen.append(e)
        if on_event is not None:
            on_event(seen)

    return launcher.run(lines.append, event), seen, lines


def event_losses(seen) -> dict[int, float]:
    """{step: loss} of the Train events (a step reported twice: the last report)."""
    from stoker.contracts import events

    return {e.step: e.loss for e in seen if isinstance(e, events.Train)}


def newest_weights(store, run: str, step: int, cache: str) -> dict:
    """Every tensor of the run's newest checkpoint (asserted to be of `step`), rehydrated
    into `cache` and read without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    from stoker.storage.checkpoints import list_checkpoints, rehydrate

    newest = list_checkpoints(store, run)[0]
    assert newest.step == step
    path = rehydrate(store, newest.key, cache)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Two checkpoints' tensors equal bit for bit (NaN where both are NaN: an unset RNG slot)."""
    import torch

    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k


def assert_a_stop_left_a_resume_point(store, run: str) -> None:
    """What a stop (a cancel, a SIGTERM, a killed launcher) leaves: the ranks logged one stop at
    a step boundary, and resume has a committed checkpoint to take: the one written on the way
    out when it fit into the grace period and its upload finished in it (`saved`). Without
    `saved` it is an older one, or the stop's own when its upload finished after the grace
    (the rank waits a little more on its way out; a hog run saw that). A folder newer than it
    can only be a write the stop cut short (no manifest: a background upload still running
    when the rank left, on a loaded machine), never a committed checkpoint that fails its
    check."""
    from stoker.storage.checkpoints import find_latest_valid

    records = [json.loads(line) for line in store.read_bytes(f"runs/{run}/metrics.jsonl").splitlines()]
    stopped = [r for r in records if r["event"] == "stopped"]
    assert len(stopped) == 1, records[-5:]
    choice = find_latest_valid(store, run)
    assert choice.checkpoint is not None, choice.skipped
    newer = [(ref.key, reason) for ref, reason in choice.skipped]
    assert all(reason.startswith("no manifest") for _, reason in newer), newer
    if stopped[0]["saved"]:
        assert choice.checkpoint.step == stopped[0]["step"], newer
    else:
        assert choice.checkpoint.step <= stopped[0]["step"], newer


def train_losses(records: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in records if m["event"] == "train"}


def wait_until_training(pid: int, metrics, seconds: float = 240) -> dict[int, Proc]:
    """Every process seen below `pid` until its ranks train (a training.train process is up
    and rank 0 has stored its first log lines in `metrics`); asserts they got there."""
    seen, deadline = {}, time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update(descendants(pid))
        if any("training.train" in p.cmdline for p in seen.values()) and metrics.exists():
            break
        time.sleep(0.5)
    assert any("training.train" in p.cmdline for p in seen.values()), "the ranks never started"
    return seen


def one_rank_run(tmp_path_factory, run: str, **sections):
    """A run folder as the flow pins it, and its checkpoint of step 4, committed by one real
    rank (forked from a warm zygote: tests.forked_ranks; a tokenizer of 300 ids unless
    `sections` say otherwise). Returns (config, store, shards, config URL): for tests of what
    reads a checkpoint (export, the harness, the evaluation sets)."""
    from stoker.config import load_config
    from stoker.storage.runs import pin_run_folder
    from tests.forked_ranks import run_forked

    sections = {
        "tokenizer": {"vocab_size": 300},
        "train": {"max_steps": 4},
        "checkpoint": {"interval_steps": 4},
        "eval": {"interval_steps": 4},
        "launch": {"nproc_per_node": 1},
        **sections,
    }
    root = "file://" + str(tmp_path_factory.mktemp(run) / "store")
    cfg = load_config(tiny_dict(root, run_name=run, **sections))
    store, shards = prepare_shards(cfg)
    config_url = pin_run_folder(store, cfg, shards)
    run_forked(config_url, shards.key, nproc=1)
    return cfg, store, shards, config_url
