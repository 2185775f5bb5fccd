"""CPU seconds by kind of process while a command runs: which processes a test run pays for.

    python3 scripts/cpu_by_process.py [--interval 0.5] [--out FILE.json] -- make test

Every `--interval` seconds it reads /proc/<pid>/stat of every process on the machine and keeps,
per process (pid and start time), the highest user + system CPU seen. At the end each
process's CPU since the command started is summed by kind (a rank, a torchrun agent, a Prefect
server, a Ray worker... by its command line) and printed, with the number of processes of that
kind. A process that lives less than one interval is missed, and a process is counted up to
its last sample: the figures are a lower bound (a few percent under the cgroup's total at
0.5 s). Counts every process on the machine, so run it with nothing else busy.

tests/cpu_per_test.py says which *test* used the CPU; this says which *process*.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

# (pattern on the command line, kind), the first match wins
KINDS = [
    (r"torch\.distributed\.run|torchrun", "torchrun agent"),
    (r"stoker\.training\.ray_main", "Ray driver (stoker.training.ray_main)"),
    (r"stoker\.training\.train", "rank (stoker.training.train)"),
    (r"-m tests\.forked_ranks", "forked rank or its zygote (tests.forked_ranks)"),
    (r"stoker\.training\.evaluation_main", "evaluation"),
    (r"prefect\.engine", "Prefect flow-run process"),
    (r"_workspace_supervisor", "Prefect runner's workspace supervisor"),
    (r"prefect server start|uvicorn", "Prefect server"),
    (r"prefect worker", "Prefect worker"),
    (r"prefect.*deploy", "prefect deploy"),
    (r"stoker\.cli", "stoker CLI"),
    (r"exec\(eval\(sys\.stdin", "pytest-xdist worker"),
    (r"pytest", "pytest"),
    (r"moto_server|moto\.server|keyed_moto", "moto (S3)"),
    # a Ray worker's command line names the raylet (--raylet-ip-address): workers first
    (r"ray::|default_worker", "Ray worker or actor"),
    (r"ray/util/client|ray\.util\.client", "Ray Client server"),
    (r"(^|/)raylet( |$)", "Ray raylet"),
    (r"gcs_server", "Ray GCS"),
    (r"dashboard|runtime_env", "Ray dashboard or agents"),
    (r"chrom", "Chromium"),
    (r"ipykernel|jupyter|nbclient", "notebook kernel"),
    (r"pip install|-m pip", "pip"),
]


def kind(cmdline: str) -> str:
    for pattern, name in KINDS:
        if re.search(pattern, cmdline):
            return name
    return "other: " + cmdline[:100]


def sample(seen: dict, tick: int) -> None:
    """Update `seen[(pid, start)] = [cpu seconds, command line]` from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            key = (int(entry), fields[19])  # pid, start time: a reused pid is another process
            if key in seen:
                seen[key][0] = max(seen[key][0], cpu)
                continue
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read().replace("\0", " ").strip()
            seen[key] = [cpu, cmdline or "[" + stat[stat.index("(") + 1 : stat.rindex(")")] + "]"]
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            pass  # gone between the listing and the read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--out", help="also write the table as JSON here")
    parser.add_argument("--top", type=int, default=25, help="kinds printed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- make test")

    tick = os.sysconf("SC_CLK_TCK")
    seen: dict = {}
    sample(seen, tick)
    before = {key: value[0] for key, value in seen.items()}  # what ran before is not counted
    start = time.monotonic()
    proc = subprocess.Popen(command)
    try:
        while proc.poll() is None:
            sample(seen, tick)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        proc.wait()
    sample(seen, tick)
    wall = time.monotonic() - start

    cpu: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    processes = []  # (CPU-s, command line), for --out: to classify again, or look closer
    me = os.getpid()
    for (pid, start_time), (seconds, cmdline) in seen.items():
        used = seconds - before.get((pid, start_time), 0.0)
        if pid != me and used > 0:
            name = kind(cmdline)
            cpu[name] += used
            count[name] += 1
            processes.append((round(used, 2), cmdline[:500]))
    total = sum(cpu.values())
    print(f"\ncpu_by_process: {total:.0f} CPU-s in {wall:.0f} s ({total / wall:.2f} cores on average)")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6}  kind")
    for name, seconds in cpu.most_common(args.top):
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count[name]:6d}  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "wall": wall,
                    "kinds": [{"kind": k, "cpu": v, "processes": count[k]} for k, v in cpu.most_common()],
                    "processes": [{"cpu": c, "cmdline": line} for c, line in sorted(processes, reverse=True)],
                },
                f,
                indent=1,
            )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
