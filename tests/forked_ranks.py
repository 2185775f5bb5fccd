"""Ranks of ``stoker.training.train`` without torchrun, for the tests whose subject is training,
not the launcher: each rank is still a process of its own, but it is forked from a warm zygote
(a python that has already imported torch, stoker and s3fs) instead of started fresh, so a run
costs no interpreter start-up, no ~2.6 CPU-seconds of imports per rank and no torchrun agent.

One zygote per rank slot (rank k of every run is forked from zygote k), started on first use
in this pytest worker and stopped at the session's end (or when the worker dies: the zygote
reads its requests from a pipe and ends, killing its ranks, at the pipe's end). A zygote per
slot, not one for all ranks, keeps what a fork copies different between the ranks of a run, as
fresh processes have it: the hash seed of str/bytes (the iteration order of sets), the state
of `random`.

A forked rank gets what torchrun gives a rank: RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK,
LOCAL_WORLD_SIZE, WORLD_SIZE, GROUP_WORLD_SIZE, ROLE_WORLD_SIZE, MASTER_ADDR/MASTER_PORT (rank
0 hosts the c10d store, as init_process_group's env:// does), TORCHELASTIC_RESTART_COUNT=0,
TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE (so @record files its
error and the rank says its numbers), OMP_NUM_THREADS=1 for several ranks; a session of its
own; its standard output and error in files of its own (out/rank-K.out, .err); `sys.argv` as
``python -m stoker.training.train`` has it; and then it runs train's main to a normal
interpreter exit (non-daemon threads joined, atexit handlers run), whose status it exits with.

A zygote imports what every rank imports (stoker.training.train, s3fs, and torch._inductor
with torch._dynamo, which torch.use_deterministic_algorithms pulls in), then forks. It stays
single-threaded in Python (asserted). Importing torch starts one native thread, numpy's
OpenBLAS server, which OpenBLAS's own fork handler (pthread_atfork) stops before a fork; the
zygote touches no tensor, CUDA or OpenMP pool before forking.
Tests that need a GPU, or whose subject is torchrun (restarts, its agent, its error files),
keep conftest.run_ranks.

Usage: ``run_forked(...)`` keeps conftest.run_ranks' contract; ``start_ranks(...)`` gives a
handle to stream the ranks' lines while they run (the outage tests act on them)."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the zygote: `python -m tests.forked_ranks` -----------------------------------------
def _serve() -> tuple[dict, int] | None:
    """Import what a rank needs, say so, then fork a rank per request read from stdin (one
    JSON line each) and report each rank's exit; {"kill": pid} kills a rank's session. Returns
    (request, zygote pid) in a forked rank; None in the zygote when stdin ends (every rank it
    still has is killed and reaped first)."""
    import threading

    import fsspec  # noqa: F401
    import s3fs  # noqa: F401

    # torch._inductor, and torch._dynamo with it: torch.use_deterministic_algorithms imports
    # them in every CPU rank (engine.configure_backends), ~1 s of CPU a rank
    import torch._inductor  # noqa: F401

    import stoker.training.train  # noqa: F401

    assert threading.active_count() == 1, threading.enumerate()  # no Python thread to copy
    sys.stdout.flush()
    sys.stderr.flush()
    reply = os.dup(1)

    def say(obj: dict) -> None:
        os.write(reply, (json.dumps(obj) + "\n").encode())

    say({"ready": os.getpid()})
    live: set[int] = set()
    buf = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:  # the pytest worker is gone or done: nothing outlives it
                for pid in live:
                    _kill_session(pid)
                for pid in live:
                    os.waitpid(pid, 0)
                return None
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    if request["kill"] in live:  # not reaped yet: the pid is still the rank's
                        _kill_session(request["kill"])
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.close(reply)
                    return request, os.getppid()
                live.add(pid)
                say({"started": pid})
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live.discard(pid)
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _kill_session(pid: int) -> None:
    """SIGKILL a rank and what it started in its session (its process group)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _become_rank(request: dict, zygote: int) -> None:
    """In the forked child: become the rank `request` describes and run train's main."""
    import random

    from stoker.process.lifeline import set_parent_death_signal

    os.setsid()  # as torchrun starts its ranks: a session each
    set_parent_death_signal(signal.SIGKILL, parent=zygote)
    out, rank = request["out"], request["env"]["RANK"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, f"rank-{rank}.out"), (2, f"rank-{rank}.err")):
        f = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh process seeds `random` from the OS; a fork copies the zygote's
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()

    from stoker.training import train

    sys.argv = [train.__file__, *request["argv"]]
    train.main(request["argv"])


# ---- the pytest side ----------------------------------------------------------------------
class _Zygote:
    """One warm zygote process and its pipes."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile(prefix="stoker-zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_ranks"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        self.buf = b""

    def wait_ready(self) -> None:
        ready = self.read(timeout=180)
        assert ready and "ready" in ready, f"the zygote did not start: {self.tail()}"

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict | None:
        """The zygote's next report, or None when none came within `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                raise RuntimeError(f"the zygote ended: {self.tail()}")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        """Close its stdin (it kills and reaps its ranks, then exits); SIGKILL after 30 s."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        os.unlink(self.log.name)


_ZYGOTES: list[_Zygote] = []


def _zygotes(n: int) -> list[_Zygote]:
    """The first `n` zygotes; those missing are started side by side."""
    new = [_Zygote() for _ in range(n - len(_ZYGOTES))]
    _ZYGOTES.extend(new)
    for zygote in new:
        zygote.wait_ready()
    return _ZYGOTES[:n]


_OUT: list[str] = []  # the folder of every run's output files, removed with the zygotes


def _out_root() -> str:
    if not _OUT:
        _OUT.append(tempfile.mkdtemp(prefix="stoker-forked-ranks-"))
    return _OUT[0]


_OPEN: list["Ranks"] = []  # runs not closed yet (a test that failed half-way)


def stop_zygotes() -> None:
    """Stop every zygote of this process (conftest calls it at the session's end); they kill
    and reap the ranks they still have."""
    _OPEN.clear()
    while _ZYGOTES:
        _ZYGOTES.pop().stop()
    while _OUT:
        shutil.rmtree(_OUT.pop(), ignore_errors=True)


atexit.register(stop_zygotes)


class Ranks:
    """`nproc` ranks of one run, forked from the zygotes. Every rank is killed (its session
    too) when one fails, on `kill()`, and on `close()` if any is still running."""

    def __init__(self, argv: list[str], nproc: int, env: dict, cwd: str = ROOT):
        from stoker.launch.torchrun import free_port

        while _OPEN:  # a zygote forks the next run only when its last one is reaped
            _OPEN.pop().close()
        self.out = tempfile.mkdtemp(prefix="ranks-", dir=_out_root())
        self.zygotes = _zygotes(nproc)
        self.codes: dict[int, int] = {}  # rank -> exit status, once reaped
        self.pids: list[int] = []
        self._offsets, self._partial = [0] * nproc, [b""] * nproc
        _OPEN.append(self)
        common = {
            "LOCAL_WORLD_SIZE": str(nproc),
            "WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            # a restart round, as torchrun's agent numbers it, where a test says so
            "TORCHELASTIC_RESTART_COUNT": env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "forked-" + os.path.basename(self.out),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        if nproc > 1 and "OMP_NUM_THREADS" not in env:
            common["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks
        for rank, zygote in enumerate(self.zygotes):
            error_file = os.path.join(self.out, str(rank), "error.json")
            os.makedirs(os.path.dirname(error_file))
            rank_env = {**env, **common, "TORCHELASTIC_ERROR_FILE": error_file}
            rank_env.update({k: str(rank) for k in ("RANK", "LOCAL_RANK", "ROLE_RANK")})
            zygote.send({"argv": argv, "env": rank_env, "cwd": cwd, "out": self.out})
            started = zygote.read(timeout=60)
            assert started and "started" in started, f"zygote {rank} forked no rank: {zygote.tail()}"
            self.pids.append(started["started"])

    @property
    def returncode(self) -> int | None:
        """None while a rank runs; 0 when all succeeded; else the first failure's status."""
        if len(self.codes) < len(self.pids):
            return None
        failed = [c for c in self.codes.values() if c != 0]
        return failed[0] if failed else 0

    def _pump(self, seconds: float) -> None:
        """Take the zygotes' exit reports for up to `seconds`; kill every rank once one failed."""
        waiting = {z.proc.stdout: (rank, z) for rank, z in enumerate(self.zygotes) if rank not in self.codes}
        if not waiting:
            return
        ready = [f for f in waiting if waiting[f][1].buf]
        if not ready:
            ready = select.select(list(waiting), [], [], seconds)[0]
        for f in ready:
            rank, zygote = waiting[f]
            report = zygote.read(timeout=0.01)
            if report is not None:
                assert report.get("exited") == self.pids[rank], report
                self.codes[rank] = report["code"]
                if report["code"] != 0:
                    self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still running (and its session)."""
        for rank, zygote in enumerate(self.zygotes):
            if rank not in self.codes:
                zygote.send({"kill": self.pids[rank]})

    def _new_lines(self, final: bool = False) -> list[str]:
        lines = []
        for rank in range(len(self.pids)):
            path = os.path.join(self.out, f"rank-{rank}.out")
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            self._offsets[rank] += len(data)
            data = self._partial[rank] + data
            *done, self._partial[rank] = data.split(b"\n")
            if final and self._partial[rank]:
                done, self._partial[rank] = [*done, self._partial[rank]], b""
            lines += [f"[rank{rank}]:" + d.decode(errors="replace") for d in done]
        return lines

    def lines(self, timeout: float) -> Iterator[str]:
        """Each rank's standard output lines ("[rankK]:..."), as they come, until every rank
        ended. Past `timeout` seconds every rank is killed and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            yield from self._new_lines()
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the ranks ran past {timeout} s\n{self.tails()}")
            self._pump(0.05)
        yield from self._new_lines(final=True)

    def wait(self, timeout: float) -> int:
        for _ in self.lines(timeout):
            pass
        return self.returncode

    def close(self) -> None:
        """Kill what still runs and wait until the zygotes reaped it."""
        if self.returncode is None:
            self.kill()
            deadline = time.monotonic() + 60
            while self.returncode is None and time.monotonic() < deadline:
                self._pump(0.5)
        assert self.returncode is not None, f"ranks {self.pids} were not reaped"
        if self in _OPEN:
            _OPEN.remove(self)

    def tails(self, chars: int = 3000) -> str:
        out = []
        for rank in range(len(self.pids)):
            for kind in ("out", "err"):
                path = os.path.join(self.out, f"rank-{rank}.{kind}")
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        out.append(f"--- rank {rank} std{kind} (exit {self.codes.get(rank)}):\n{f.read()[-chars:]}")
        return "\n".join(out)

    def remove(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)


def start_ranks(argv: list[str], nproc: int = 2, env: dict | None = None) -> Ranks:
    """`nproc` ranks of `python -m stoker.training.train <argv>` with the tests' environment
    (`env` added); see Ranks."""
    return Ranks(argv, nproc, {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **(env or {})})


def train_argv(config_url: str, shard_key: str, resume: str | None = None, cache_dir: str | None = None) -> list[str]:
    argv = ["--config", config_url, "--shards", shard_key]
    if resume:
        argv += ["--resume-from", resume]
    if cache_dir:
        argv += ["--cache-dir", cache_dir]
    return argv


def run_forked(
    config_url: str,
    shard_key: str,
    resume: str | None = None,
    nproc: int = 2,
    timeout: int = 240,
    cache_dir: str | None = None,
    env: dict | None = None,
) -> list[dict]:
    """conftest.run_ranks without torchrun: `nproc` forked ranks of training.train on this
    host; assert they succeed and return their events (decoded metric lines)."""
    ranks = start_ranks(train_argv(config_url, shard_key, resume, cache_dir), nproc, env)
    try:
        lines = list(ranks.lines(timeout))
        assert ranks.returncode == 0, ranks.tails()
    finally:
        ranks.close()
        ranks.remove()
    return [json.loads(line.split("STOKER_METRIC ", 1)[1]) for line in lines if "STOKER_METRIC " in line]


if __name__ == "__main__":
    job = _serve()
    if job is not None:
        _become_rank(*job)
