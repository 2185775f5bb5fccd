"""A soup of two checkpoints (training.soup_main.average_folders) on a Llama-shaped model.

Two DCP checkpoints of a Llama-shaped model (fp32 weights; with --optim, AdamW's two moments too),
as one training rank writes them, are averaged into a third, each in a fresh process:

1. The soup's time over a plain copy of the bytes of both checkpoints (every file copied, in
   the same run, from the page cache as the soup reads them).                 goal <= 1.5
2. The soup process's peak RSS (VmHWM; ru_maxrss would keep the forking parent's across exec) less its fixed overhead (the peak of the same process
   that imports the same modules and reads the two checkpoints' metadata, averaging nothing),
   over the largest tensor.                                                     goal <= 2

    python -m benchmarks.bench_soup [--hidden 1024 --layers 8 --vocab 32000] [--optim] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MB = 1 << 20

_CHILD = r"""
import json, sys, time
from stoker.training.soup_main import Input, average_folders
a, b, out, mode = sys.argv[1:5]
t0 = time.perf_counter()
if mode == "soup":
    average_folders([a, b], [0.5, 0.5], 1, out)
else:
    Input(a).close(); Input(b).close()
seconds = time.perf_counter() - t0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": seconds, "peak": int(hwm.split()[1]) * 1024}))
"""


def _write_checkpoint(folder: str, hidden: int, layers: int, vocab: int, optim: bool, seed: int) -> tuple[int, int]:
    """A Llama-shaped DCP checkpoint with random weights: (bytes, largest tensor bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    inter = int(hidden * 8 / 3) // 64 * 64
    kv = max(1, hidden // 4)
    shapes = {"model.tok_embeddings.weight": (vocab, hidden), "model.output.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "attention.wq.weight": (hidden, hidden),
            p + "attention.wk.weight": (kv, hidden),
            p + "attention.wv.weight": (kv, hidden),
            p + "attention.wo.weight": (hidden, hidden),
            p + "feed_forward.w1.weight": (inter, hidden),
            p + "feed_forward.w2.weight": (hidden, inter),
            p + "feed_forward.w3.weight": (inter, hidden),
            p + "attention_norm.weight": (hidden,),
            p + "ffn_norm.weight": (hidden,),
        }
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    if optim:
        for k, s in shapes.items():
            name = k[len("model.") :]
            state[f"optim.{name}.exp_avg"] = torch.randn(s, generator=g)
            state[f"optim.{name}.exp_avg_sq"] = torch.rand(s, generator=g)
            state[f"optim.{name}.step"] = torch.tensor(100.0)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    with open(os.path.join(folder, "train_state.json"), "w") as f:
        json.dump({"step": 100}, f)
    largest = max(t.numel() * t.element_size() for t in state.values())
    return sum(t.numel() * t.element_size() for t in state.values()), largest


def _child(a: str, b: str, out: str, mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", _CHILD, a, b, out, mode], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _copy_both(a: str, b: str, into: str) -> float:
    t0 = time.perf_counter()
    for src in (a, b):
        dst = os.path.join(into, os.path.basename(src))
        os.makedirs(dst)
        for name in os.listdir(src):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--optim", action="store_true", help="with AdamW's moments (3x the bytes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny model: checks the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.repeats = 64, 2, 512, 1
    work = tempfile.mkdtemp(prefix="stoker-bench-soup-")
    try:
        a, b = os.path.join(work, "a"), os.path.join(work, "b")
        size, largest = _write_checkpoint(a, args.hidden, args.layers, args.vocab, args.optim, 1)
        _write_checkpoint(b, args.hidden, args.layers, args.vocab, args.optim, 2)
        _copy_both(a, b, tempfile.mkdtemp(dir=work))  # warm the page cache for both sides
        soups, copies, peaks = [], [], []
        for i in range(args.repeats):
            copies.append(_copy_both(a, b, tempfile.mkdtemp(dir=work)))
            done = _child(a, b, os.path.join(work, f"soup{i}"), "soup")
            soups.append(done["seconds"])
            peaks.append(done["peak"])
        overhead = _child(a, b, "", "metadata")["peak"]
        soup_s, copy_s, peak = min(soups), min(copies), max(peaks)
        out = {
            "model_mb": round(size / MB, 1),
            "largest_tensor_mb": round(largest / MB, 1),
            "soup_s": round(soup_s, 3),
            "copy_s": round(copy_s, 3),
            "time_ratio": round(soup_s / copy_s, 3),
            "peak_rss_mb": round(peak / MB, 1),
            "fixed_overhead_mb": round(overhead / MB, 1),
            "rss_over_largest": round((peak - overhead) / largest, 3),
        }
        print(json.dumps(out, indent=2))
        print(f"time: soup / copy of both checkpoints' bytes = {out['time_ratio']} (goal <= 1.5)")
        print(f"memory: (peak RSS - fixed overhead) / largest tensor = {out['rss_over_largest']} (goal <= 2)")
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
