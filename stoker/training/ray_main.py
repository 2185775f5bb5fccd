"""The Ray driver: ``python -m stoker.training.ray_main --config URL --shards KEY [--resume-from K]
--result FILE`` runs the same rank code as torchrun's ranks (``training.train.run_rank``) in
Ray Train workers (``TorchTrainer``: Ray starts one worker per rank and sets up the process
group, which the rank code joins). ``launch.ray.RayLauncher`` starts this process like a
torchrun agent and reads its output and its result file.

Ray's own log forwarding prints worker lines with prefixes of its own, and can repeat or
deduplicate them; so the workers send their output lines (events included) to a relay
actor made by this driver, and the driver prints them in the torchrun form
(``[default<rank>]:<line>``), in order per rank, exactly once. The relay also carries:
- the stop: SIGTERM to the driver (a Prefect cancel, Ctrl-C) is relayed to every worker, which
  stops at a step boundary as a torchrun rank does on SIGTERM (a stop checkpoint when it fits);
- restarts: ``FailureConfig(max_failures=launch.max_restarts)`` lets Ray restart the worker
  group after a failure; the relay counts each rank's starts, so a restarted group resumes from
  the newest valid checkpoint (as torchrun's in-place restarts do), and a permanent failure is
  not repeated: restarted workers end at once with it;
- why the run ended: the ranks' Failure records and the ranks that ended without raising
  (a killed worker), written to the result file for the launcher's classification.

Credentials and the rank environment (STOKER_*, AWS_*) reach the workers inside the train
loop's config (the object store), never in a runtime_env (which Ray shows in its dashboard).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

from stoker.contracts import events
from stoker.process.quick_exit import quick_exit

# the rank code (torch) is imported where it runs, in the workers and the driver: the relay
# actor's process imports this module for the Relay class alone, and would import torch for
# nothing (a few CPU seconds, ~300 MB, per launch)

# how often workers ship their lines and the driver drains them: each drain is a round trip
# through the head (through its Ray Client server, for a driver off the cluster) for the whole
# launch; a line shown half a second later costs nobody anything
POLL_SECONDS = 0.5
STOP_POLL_SECONDS = 0.5
# passed to the workers: what a torchrun rank inherits from the launcher (never the node's own
# cache folder or the gang id: those belong to the host the driver runs on)
_RANK_ENV_PREFIXES = ("STOKER_", "AWS_", "TOKENIZERS_", "PYTHONUNBUFFERED")
_HOST_ONLY = {"STOKER_CACHE", "STOKER_GANG_ID", "STOKER_CLI_CHILD"}


def rank_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_RANK_ENV_PREFIXES) and k not in _HOST_ONLY}


class Relay:
    """The driver's actor: output lines in, stop requests out, starts and ends counted."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.lines: list[tuple[int, str]] = []
        self.stop = False
        self.starts = [0] * world_size
        self.running: set[int] = set()
        self.failures: list[dict] = []
        self.permanent: dict | None = None

    def begin(self, rank: int) -> dict:
        """A worker starts: is this a restart round, and did a rank fail for good before?"""
        self.starts[rank] += 1
        self.running.add(rank)
        return {"restart": self.starts[rank] > 1, "failed": self.permanent, "stop": self.stop}

    def write(self, rank: int, lines: list[str]) -> None:
        self.lines.extend((rank, line) for line in lines)

    def drain(self) -> list[tuple[int, str]]:
        out, self.lines = self.lines, []
        return out

    def request_stop(self) -> None:
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop

    def failed(self, failure: dict) -> None:
        self.failures.append(failure)
        self.running.discard(failure["rank"])
        if not failure["transient"] and self.permanent is None:
            self.permanent = failure

    def done(self, rank: int) -> None:
        self.running.discard(rank)

    def summary(self) -> dict:
        return {
            "failures": self.failures,
            "running": sorted(self.running),
            "starts": list(self.starts),
            "stop": self.stop,
        }


# ---- in each worker ------------------------------------------------------------------------
class _RelayWriter:
    """sys.stdout/sys.stderr of a worker: whole lines go to the relay, in batches, in order."""

    def __init__(self, relay, rank: int):
        self.relay, self.rank = relay, rank
        self.partial = ""
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.last_call = None

    def write(self, text: str) -> int:
        with self.lock:
            self.partial += text
            *whole, self.partial = self.partial.split("\n")
            self.pending.extend(whole)
        return len(text)

    def flush(self, wait: bool = False) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
            if lines:
                self.last_call = self.relay.write.remote(self.rank, lines)
        if wait and self.last_call is not None:
            import ray

            ray.get(self.last_call)

    def close(self) -> None:
        with self.lock:
            if self.partial:
                self.pending.append(self.partial)
                self.partial = ""
        self.flush(wait=True)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def _watch(relay, writer: _RelayWriter, done: threading.Event) -> None:
    """Ship output lines every POLL_SECONDS; relay a stop request to this rank's loop."""
    import ray

    from stoker.training.distributed import request_stop

    last_stop_check = 0.0
    while not done.wait(POLL_SECONDS):
        writer.flush()
        if time.monotonic() - last_stop_check >= STOP_POLL_SECONDS:
            last_stop_check = time.monotonic()
            try:
                if ray.get(relay.stop_requested.remote(), timeout=5):
                    request_stop()
            except ray.exceptions.GetTimeoutError:  # a busy relay, not a lost one
                pass
            except Exception:  # the relay died with its driver: stop as a cancel does (Ray
                request_stop()  # ends the job's actors too, but not always before a checkpoint)


def train_worker(loop_config: dict) -> None:
    """The function each Ray Train worker runs (Ray has set RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT and the process group)."""
    os.environ.update(loop_config["env"])
    # a worker computes on the CPUs it reserved (ray.cpus_per_worker), whatever the node has
    os.environ["STOKER_CPU_THREADS"] = str(max(1, int(loop_config["cpus"])))
    relay, rank = loop_config["relay"], int(os.environ["RANK"])
    import ray

    from stoker.training.distributed import Preempted
    from stoker.training.train import FailedBefore, before_message, failure_of, run_rank

    writer, done = _RelayWriter(relay, rank), threading.Event()
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = writer
    watcher = threading.Thread(target=_watch, args=(relay, writer, done), daemon=True)
    watcher.start()
    try:
        begun = ray.get(relay.begin.remote(rank))
        if begun["stop"]:
            return  # the run was stopped while Ray restarted the group
        if begun["failed"] is not None:
            raise FailedBefore(before_message(events.from_dict(begun["failed"])))
        run_rank(
            loop_config["config_url"],
            loop_config["shards"],
            loop_config["resume_from"],
            loop_config["cache_dir"] or _cache_dir(),
            begun["restart"],
        )
        ray.get(relay.done.remote(rank))
    except Preempted:
        if not ray.get(relay.stop_requested.remote()):
            raise
        ray.get(relay.done.remote(rank))  # a stop asked for: not a failure Ray should retry
    except BaseException as exc:
        failure = failure_of(exc)
        from stoker.training.metrics import emit

        emit(failure)
        ray.get(relay.failed.remote(failure.to_dict()))
        raise
    finally:
        done.set()
        watcher.join(timeout=5)
        writer.close()
        sys.stdout, sys.stderr = saved


def _cache_dir() -> str:
    from stoker.storage.store import default_cache_dir

    return default_cache_dir()  # the node's: STOKER_CACHE of its raylet, else the default


# ---- the driver ----------------------------------------------------------------------------
def _connect(address: str | None, cpus: float):
    from stoker.process import ray_connect

    common = dict(log_to_driver=False, namespace="stoker")
    if address is None:  # a local Ray for this launch, on loopback only, stopped when we end
        return ray_connect.start_local(max(1, int(cpus + 0.999)), **common)
    return ray_connect.connect(address, **common)


def _use_gpu(cfg, ray) -> bool:
    if cfg.launch.backend == "gloo":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.launch.backend == "nccl" and gpus < cfg.launch.world_size:
        raise RuntimeError(
            f"launch.backend: 'nccl' needs {cfg.launch.world_size} GPUs and the Ray cluster has {gpus:g}"
        )
    return gpus >= cfg.launch.world_size


def drive(args: argparse.Namespace) -> int:
    """Run the workers to the end; write the result file; the exit status of the launch."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from stoker.storage.runs import read_config  # not training.train: the rank code stays out
    from stoker.training.distributed import stop_grace_seconds

    stop_asked = threading.Event()
    result = {"failures": [], "running": [], "launcher_errors": [], "completed": False}
    try:
        cfg = read_config(args.config)
        lc, world = cfg.launch, cfg.launch.world_size
        _connect(cfg.ray.address, world * cfg.ray.cpus_per_worker)
        # after ray.init, which sets a SIGTERM handler of its own that exits at once
        signal.signal(signal.SIGTERM, lambda *_: stop_asked.set())
        signal.signal(signal.SIGINT, lambda *_: stop_asked.set())
        use_gpu = _use_gpu(cfg, ray)
        relay = ray.remote(num_cpus=0)(Relay).remote(world)
        resources = {"CPU": cfg.ray.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        # Ray Train's own run folder (stoker's checkpoints go to the store): removed at the end
        ray_storage = os.path.join(
            tempfile.gettempdir(), "stoker-ray-train", f"stoker-{cfg.resolved_run_name()}-{uuid.uuid4().hex[:8]}"
        )
        trainer = _trainer_class()(
            train_worker,
            train_loop_config={
                "relay": relay,
                "env": rank_env(dict(os.environ)),
                "config_url": args.config,
                "shards": args.shards,
                "resume_from": args.resume_from,
                "cache_dir": args.cache_dir,
                "cpus": cfg.ray.cpus_per_worker,
            },
            scaling_config=ScalingConfig(num_workers=world, use_gpu=use_gpu, resources_per_worker=resources),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=lc.collective_timeout_seconds),
            run_config=RunConfig(
                name=os.path.basename(ray_storage),
                storage_path=os.path.dirname(ray_storage),
                failure_config=FailureConfig(max_failures=lc.max_restarts),
            ),
        )
        print(
            f"Ray: {world} worker(s) on {ray.cluster_resources().get('CPU', 0):g} CPU(s), "
            f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s), gpu={use_gpu}",
            flush=True,
        )
        outcome: dict = {}
        fit = threading.Thread(target=_fit, args=(trainer, outcome), daemon=True)
        fit.start()
        stop_sent: float | None = None  # when the stop was relayed
        # past this, workers that have not stopped are ended with the job (ray.shutdown below)
        stop_budget = stop_grace_seconds() + 30.0
        try:
            while fit.is_alive():
                fit.join(POLL_SECONDS)
                if stop_asked.is_set() and stop_sent is None:
                    relay.request_stop.remote()
                    stop_sent = time.monotonic()
                _print_lines(ray.get(relay.drain.remote()))
                if stop_sent is not None and time.monotonic() - stop_sent > stop_budget:
                    print(
                        f"Ray: the workers did not stop within {stop_budget:.0f} s of the stop; "
                        "ending the job, which ends them",
                        flush=True,
                    )
                    outcome.setdefault("error", TimeoutError("the workers did not stop in time"))
                    break
        finally:
            shutil.rmtree(ray_storage, ignore_errors=True)
        _print_lines(ray.get(relay.drain.remote()))
        summary = ray.get(relay.summary.remote())
        result.update(failures=summary["failures"], starts=summary["starts"])
        error = outcome.get("error")
        if error is not None:
            result["running"] = summary["running"]
            if not summary["failures"] and not summary["running"]:
                result["launcher_errors"].append((type(error).__name__, str(error)[:2000]))
            print(
                f"Ray Train ended with {type(error).__name__}: {str(error).splitlines()[0][:500] if str(error) else ''}",
                flush=True,
            )
        result["completed"] = error is None and not summary["stop"]
        result["stopped"] = summary["stop"]
    except Exception as exc:  # no cluster, a bad address: the launcher classifies the message
        result["launcher_errors"].append((type(exc).__name__, str(exc)[:2000]))
        print(f"Ray driver failed: {type(exc).__name__}: {exc}", flush=True)
    finally:
        with open(args.result, "w") as f:
            json.dump(result, f)
        try:
            ray.shutdown()
        except Exception:
            pass
    if result["completed"]:
        return 0
    return 143 if result.get("stopped") else 1


# Ray Train's per-launch helper actors that a stoker launch has no use for (a process, and
# ~2 CPU-seconds of imports, each): the DatasetManager, made on every start of the worker
# group to hand out Ray Data shards (the workers read stoker's shard sets, no Ray Dataset is
# passed); the PlacementGroupCleaner, a detached actor polling the controller every second to
# remove its placement groups should it die while the driver lives on (this driver ends the
# job when the launch ends, and a job's placement groups end with it)
_UNNEEDED_CALLBACKS = ("DatasetsCallback", "PlacementGroupCleanerCallback")


def _trainer_class():
    """TorchTrainer without the callbacks of _UNNEEDED_CALLBACKS (a Ray that names them
    otherwise keeps them: only two processes more)."""
    from ray.train.torch import TorchTrainer

    class StokerTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return [cb for cb in callbacks if type(cb).__name__ not in _UNNEEDED_CALLBACKS]

    return StokerTrainer if hasattr(TorchTrainer, "_create_default_callbacks") else TorchTrainer


def _fit(trainer, outcome: dict) -> None:
    try:
        outcome["result"] = trainer.fit()
        outcome["error"] = getattr(outcome["result"], "error", None)
    except BaseException as exc:  # TrainingFailedError: a worker raised or died past max_failures
        outcome["error"] = exc


def _print_lines(lines: list[tuple[int, str]]) -> None:
    try:
        for rank, line in lines:
            sys.stdout.write(f"[default{rank}]:{line}\n")
        sys.stdout.flush()
    except OSError:  # a broken pipe: the launcher reading us is gone (SIGKILLed, say)
        sys.stdout = open(os.devnull, "w")
        os.kill(os.getpid(), signal.SIGTERM)  # stop as on a cancel, not die of the next print


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run a stoker launch on Ray Train workers.")
    p.add_argument("--config", required=True, help="URL or path of the run's config.json")
    p.add_argument("--shards", required=True, help="shard-set key under the store root")
    p.add_argument("--resume-from", default=None, help="checkpoint key under the store root")
    p.add_argument("--cache-dir", default=None, help="the workers' host cache (default: each node's own, STOKER_CACHE)")
    p.add_argument("--result", required=True, help="where the driver writes how the launch ended")
    return p.parse_args(argv)


if __name__ == "__main__":
    # through the imported module, so Ray pickles train_worker and Relay by reference (their
    # module is importable on every node), not by value as it would from __main__
    from stoker.training import ray_main

    quick_exit(ray_main.drive(ray_main.parse_args()))
