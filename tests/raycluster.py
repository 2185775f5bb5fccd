"""A real Ray cluster for tests: a head and worker raylets, each in a network namespace of its
own (``tests.netutil.NetnsNodes``), so Ray, gloo and storage traffic between them crosses real
interfaces, and nothing binds to this machine's outward address.

Each node gets what a real machine would have:
- its own /etc/hosts (``ip netns exec`` mounts /etc/netns/<ns>/hosts over it), where this host's
  name resolves to the node's address: Ray's and gloo's own address lookups find that address;
- ``GLOO_SOCKET_IFNAME`` (its interface), ``STOKER_CACHE`` (its own host cache) and the project
  on ``PYTHONPATH``, in the environment of its raylet and so of every worker it starts;
- its own Ray temp folder (its workers' log files; no log monitor forwards them to drivers).

Drivers in this namespace reach the cluster with Ray Client at ``client_address``. The head's
client server forks a server per client; gRPC's fork handlers crash it ("Check failed:
next_worker->state == KICKED"), so the head runs with GRPC_ENABLE_FORK_SUPPORT=0 and
GRPC_POLL_STRATEGY=poll.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from tests.netutil import NetnsNodes

# the checkout, on the nodes' PYTHONPATH: their workers import this checkout's code
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GCS_PORT = 6379
CLIENT_PORT = 10001

# Ray Train settings for the tests' Ray (a node's raylet passes them to the workers it starts,
# the Train controller included; a driver passes its own to the controller): no preemption
# watcher (an actor per launch that polls for node drains, which no test makes), and the
# controller polls its workers every 0.5 s, not 2 s (a run's end, and a killed worker, are
# seen sooner; a poll that misses is only counted as a hang after 10 min, as before)
TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
# a raylet starts as many worker processes at once as its node has CPUs (one here): a launch's
# actors on the head (relay, Train controller, its helpers, a Ray Train worker) would start one
# after another while this machine's other core idles
STARTUP_CONCURRENCY = "2"


def ray_unavailable() -> str | None:
    """Why a Ray cluster cannot be made here, or None."""
    why = NetnsNodes.unavailable()
    if why:
        return why
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install 'stoker[ray]')"
    return None


_WAIT_FOR_NODES = """
import sys, time
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions
address, num_nodes, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
state = GlobalState()
state._initialize_global_state(GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False))
deadline = time.monotonic() + timeout
while True:
    nodes = state.node_table()
    if len([n for n in nodes if n["Alive"]]) >= num_nodes:
        break
    if time.monotonic() > deadline:
        sys.exit(f"{num_nodes} nodes not alive after {timeout:.0f} s: {nodes}")
    time.sleep(0.2)
"""


class RayCluster:
    """`num_nodes` Ray nodes (node 0 the head), `cpus_per_node` CPUs each. `up()` starts them;
    `down()` stops every Ray process and removes the namespaces (safe after a partial up)."""

    def __init__(self, num_nodes: int = 2, cpus_per_node: int = 1, work_dir: str = "/tmp"):
        self.nodes = NetnsNodes(num_nodes)
        self.cpus_per_node = cpus_per_node
        self.work_dir = os.path.join(work_dir, f"stoker-ray-{self.nodes.tag}")
        self.temp_dirs = [os.path.join(self.work_dir, f"ray-n{i}") for i in range(num_nodes)]
        self.caches = [os.path.join(self.work_dir, f"cache-n{i}") for i in range(num_nodes)]

    @property
    def head_address(self) -> str:
        return self.nodes.addresses[0]

    @property
    def client_address(self) -> str:
        """Ray Client address, for drivers outside the cluster (this namespace)."""
        return f"ray://{self.head_address}:{CLIENT_PORT}"

    @property
    def gcs_address(self) -> str:
        """For drivers that run on a node (`exec_prefix(i)`)."""
        return f"{self.head_address}:{GCS_PORT}"

    @property
    def bridge_address(self) -> str:
        """Where servers that every node reaches (moto) bind."""
        return self.nodes.bridge_address

    def node_env(self, node: int) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("RAY_ADDRESS", "STOKER_GANG_ID", "PYTEST_CURRENT_TEST"):
            env.pop(name, None)
        # token authentication off, said explicitly: a local Ray started on this machine before
        # (ray.init) leaves ~/.ray/auth_token, and a head that finds it would require tokens
        env.update(
            RAY_USAGE_STATS_ENABLED="0",
            RAY_AUTH_MODE="disabled",
            GLOO_SOCKET_IFNAME=self.nodes.ifnames[node],
            STOKER_CACHE=self.caches[node],
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (CHECKOUT, env.get("PYTHONPATH")) if p),
            RAY_worker_maximum_startup_concurrency=STARTUP_CONCURRENCY,
            # Ray starts workers at nice 15; beside a busy test host that starves them (4.5x
            # slower under a CPU hog at nice 0), so the test nodes run them as a node's only job
            RAY_worker_niceness="0",
            **TRAIN_ENV,
        )
        if node == 0:
            env.update(GRPC_ENABLE_FORK_SUPPORT="0", GRPC_POLL_STRATEGY="poll")
        return env

    def _hosts_file(self, node: int) -> str:
        return os.path.join("/etc/netns", self.nodes.namespaces[node], "hosts")

    def up(self) -> "RayCluster":
        try:
            self.nodes.up()
            for i, addr in enumerate(self.nodes.addresses):
                os.makedirs(os.path.dirname(self._hosts_file(i)), exist_ok=True)
                with open(self._hosts_file(i), "w") as f:
                    f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
                os.makedirs(self.temp_dirs[i], exist_ok=True)
                os.makedirs(self.caches[i], exist_ok=True)
            for i, addr in enumerate(self.nodes.addresses):
                common = [
                    f"--node-ip-address={addr}",
                    f"--num-cpus={self.cpus_per_node}",
                    "--num-gpus=0",
                    "--disable-usage-stats",
                    f"--temp-dir={self.temp_dirs[i]}",
                    # no test reads Ray's log forwarding (the training driver relays its workers'
                    # lines itself; the data engine's tasks print nothing): a log monitor would
                    # only tail every worker's files, for nobody
                    "--include-log-monitor=false",
                ]
                if i == 0:
                    cmd = [
                        "--head",
                        f"--port={GCS_PORT}",
                        f"--ray-client-server-port={CLIENT_PORT}",
                        "--include-dashboard=false",
                        # no autoscaler: the test cluster's nodes are fixed (its monitor would
                        # poll the GCS every few seconds for the whole session, for nobody)
                        "--no-monitor",
                        *common,
                    ]
                else:
                    cmd = [f"--address={self.gcs_address}", *common]
                self._ray(i, "start", *cmd)
            self.wait_for_nodes()
        except BaseException:
            self.down()
            raise
        return self

    def _ray(self, node: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*self.nodes.exec_prefix(node), sys.executable, "-m", "ray.scripts.scripts", *args]
        out = subprocess.run(
            cmd, env=self.node_env(node), capture_output=True, text=True, timeout=120, cwd=self.work_dir
        )
        if check and out.returncode != 0:
            raise OSError(f"ray {args[0]} on node {node} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def wait_for_nodes(self, timeout: float = 60) -> None:
        """Until every node is alive in the head's view: one process on the head node asks the
        GCS for its node table every 0.2 s (not `ray status`, a fresh CLI process per look)."""
        out = subprocess.run(
            [*self.nodes.exec_prefix(0), sys.executable, "-c", _WAIT_FOR_NODES, self.gcs_address]
            + [str(len(self.nodes.addresses)), str(timeout)],
            env=self.node_env(0),
            capture_output=True,
            text=True,
            timeout=timeout + 60,
            cwd=self.work_dir,
        )
        if out.returncode != 0:
            raise TimeoutError(f"the Ray cluster did not come up:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")

    def exec_prefix(self, node: int) -> tuple[str, ...]:
        return self.nodes.exec_prefix(node)

    def worker_pids(self, pattern: str = "RayTrainWorker") -> dict[int, list[int]]:
        """{node: pids of processes whose command line holds `pattern`} (Ray names its worker
        processes after the actor class: ray::RayTrainWorker...)."""
        found: dict[int, list[int]] = {}
        for i in range(len(self.nodes.addresses)):
            for pid in self.nodes.pids(i):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if pattern in cmdline:
                    found.setdefault(i, []).append(pid)
        return found

    def down(self) -> None:
        # never `ray stop`: it finds Ray processes by name on the whole machine (a namespace
        # isolates the network only) and would stop every other cluster too; every process
        # of this cluster's nodes is in their namespaces, which down() empties
        self.nodes.down()
        for i in range(len(self.nodes.addresses)):
            shutil.rmtree(os.path.dirname(self._hosts_file(i)), ignore_errors=True)
        shutil.rmtree(self.work_dir, ignore_errors=True)
