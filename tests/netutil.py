"""Network helpers for tests: a TCP proxy on 127.0.0.1 that a test can stop and start (a
storage outage that keeps the server's state: moto_server keeps its buckets in memory), and
network namespaces on a bridge that stand in for separate machines."""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.host, self.upstream = host, upstream_port
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ---- simulated machines: network namespaces on a bridge ------------------------------------
class NetnsNodes:
    """`num_nodes` network namespaces ("nodes"), each with one veth interface and an address of
    its own; the other ends sit on a bridge in this namespace, which has an address too (servers
    bound there are reachable from every node and from the test). Traffic between nodes, and
    from a node to the bridge address, crosses real interfaces. Needs root and `ip` (iproute2).

    `down()` kills every process left in the namespaces and deletes what `up()` made; it is
    safe to call after a partial `up()` and more than once. Names carry a random tag
    (stk<tag>...) so parallel runs and leftovers never collide."""

    def __init__(self, num_nodes: int):
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"stk{self.tag}br"  # interface names: at most 15 characters
        self.namespaces = [f"stoker-{self.tag}-n{i}" for i in range(num_nodes)]
        self.ifnames = [f"stk{self.tag}n{i}" for i in range(num_nodes)]  # in the node's namespace
        self.host_ifnames = [f"stk{self.tag}h{i}" for i in range(num_nodes)]  # on the bridge
        used = _routed_networks()
        while True:  # a /24 of 10/8 that no route of this machine covers
            net = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used):
                break
        self.bridge_address = str(net[1])
        self.addresses = [str(net[10 + i]) for i in range(num_nodes)]
        self.made: list[tuple[str, str]] = []  # ("netns" | "link", name), in the order made

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        return None

    def _ip(self, *args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def up(self) -> "NetnsNodes":
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            self._ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for ns, ifname, host_if, addr in zip(self.namespaces, self.ifnames, self.host_ifnames, self.addresses):
                self._ip("netns", "add", ns)
                self.made.append(("netns", ns))
                self._ip("link", "add", host_if, "type", "veth", "peer", "name", ifname, "netns", ns)
                self.made.append(("link", host_if))  # deleting one end deletes the pair
                self._ip("link", "set", host_if, "master", self.bridge, "up")
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                self._ip("-n", ns, "link", "set", ifname, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def exec_prefix(self, node: int) -> tuple[str, ...]:
        """Runs a command inside the node's namespace (`ip netns exec` execs it: same pid)."""
        return ("ip", "netns", "exec", self.namespaces[node])

    def pids(self, node: int) -> list[int]:
        """Every process in the node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def kill(self, node: int) -> list[int]:
        """Lose the node: SIGKILL every process in its namespace (its agent and its ranks);
        returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def down(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                node = self.namespaces.index(name)
                deadline = time.monotonic() + 10
                while self.kill(node) and time.monotonic() < deadline:
                    time.sleep(0.1)
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
        self.made.clear()

    def leftovers(self) -> list[str]:
        """What of this instance still exists (namespaces, links), for a test to assert none."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [n for n in self.namespaces if n in names] + [
            n for n in [self.bridge, *self.host_ifnames] if f" {n}:" in links or f" {n}@" in links
        ]


def _routed_networks() -> list:
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True)
    nets = []
    for line in out.stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            first = line.split()[1]
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue  # "default" and the like
    return nets
