"""The GPU benchmark cannot run in CI (no GPU), so its smoke run does: every part of
benchmarks/bench_gpu.py (explore, ours against the bare loop, the kernel profile, the
checkpoint stall) at a tiny size on the CPU, so a lent GPU's minutes are not spent finding a
broken benchmark. Its figures mean nothing; what it leaves behind is checked."""

import glob
import os

from tests.conftest import prepare_shards


def test_bench_gpu_runs_every_part_in_a_cpu_smoke_run(tiny_config, capsys):
    from benchmarks import bench_gpu

    cfg = tiny_config(run_name="bench")
    store, _ = prepare_shards(cfg)
    results = sorted(glob.glob(os.path.join(bench_gpu.RESULTS, "*.json")))
    before = {p: os.path.getmtime(p) for p in results}
    try:
        bench_gpu.main(
            [
                "--smoke",
                "--store",
                cfg.storage.root,
                "--micro-batch",
                "4",
                "--rounds",
                "1",
                "--steps",
                "1",
                "--profile",
                "--explore",
                "4:default,4:default:ce64",
                "--cross-entropy-chunk",
                "100",
                "--real-variants",
                "ddp:none,fsdp:selective",
                "--real-steps",
                "6",
                "--real-warmup",
                "2",
                "--real-timeout",
                "300",
                "--llama-1b",
                "--llama-micro-batch",
                "2",
            ]
        )
    finally:
        bench_gpu.DEVICE = __import__("torch").device("cuda", 0)
    out = capsys.readouterr().out
    assert "explore 4:default:ce64:" in out
    assert "cross-entropy chunked, 100 tokens a chunk" in out and "RATIO ours/bare" in out
    assert "kernel time per step" in out and "matmul" in out
    assert "RATIO async/sync" in out
    assert '"device": "cpu (smoke run)"' in out
    assert "llama: " in out and '"model": "llama (smoke shape)"' in out
    # the real runs: torchrun of the 1-GPU recipe, timed from its events, beside the benchmark
    assert "real run ddp:none (torchrun, gpt2-124m-1gpu" in out and "real run fsdp:selective" in out
    assert "RATIO real run / benchmark trainer" in out and "step time fsdp:selective / ddp:none" in out
    assert '"padded_vocab": 384' in out and '"micro_batch": 4' in out
    # no run left in the store (only the shards), no result file written or touched
    assert not glob.glob(store.local_path("runs/bench-gpu-*"))
    assert {p: os.path.getmtime(p) for p in glob.glob(os.path.join(bench_gpu.RESULTS, "*.json"))} == before


def test_bench_data_hit_smoke_run_reads_only_manifests_on_a_hit(capsys):
    """benchmarks/bench_data_hit.py at a tiny size: its figures mean nothing; that it runs, and
    that the new cache hit reads far less than the old deep check, is checked."""
    import re

    from benchmarks import bench_data_hit

    bench_data_hit.main(["--size-mb", "2", "--file-mb", "1"])
    out = capsys.readouterr().out
    assert "RATIO bytes read new/old" in out and "RATIO time new/old" in out
    new = int(re.search(r"\(new\): .* (\d+) bytes read", out).group(1))
    old = float(re.search(r"\(old\): .*?([\d.]+) MiB read", out).group(1))
    assert old >= 2.0 and new < 64 * 1024, out


def test_bench_startup_compares_the_same_copy_of_stoker_with_and_without_bytecode(capsys):
    """A smoke run on a small module: both sides import the benchmark's copy (asserted inside),
    and the ratio line is printed; its figure means nothing at this size."""
    from benchmarks import bench_startup

    bench_startup.main(["--module", "stoker.core.failures", "--reps", "1", "--reference", ""])
    out = capsys.readouterr().out
    assert "import stoker.core.failures:" in out and "compiled (medians of 1)" in out
    assert "RATIO compiled / from source CPU-s = " in out


def test_bench_mixture_smoke_run_prints_its_ratio(capsys):
    """benchmarks/bench_mixture.py at a tiny size: three sources against one, both read."""
    from benchmarks import bench_mixture

    result = bench_mixture.main(["--smoke"])
    assert result["one_source_ms_per_step"] > 0 and result["three_sources_ms_per_step"] > 0
    assert "(exact)" in result["mixture"][0]
    assert "RATIO three sources / one source" in capsys.readouterr().out


def test_bench_data_smoke_run_counts_the_same_tokens_three_ways(capsys):
    """benchmarks/bench_data.py on a tiny corpus: the data stage, encode_batch_fast and
    Dataset.map count the same tokens (its report asserts it), every ratio printed."""
    from benchmarks import bench_data

    bench_data.main(["--smoke"])
    out = capsys.readouterr().out
    assert "tokenize+shard tok/CPU-s / raw encode_batch_fast" in out and "all hits: True" in out


def test_every_benchmark_imports_and_has_a_main():
    """The cheapest guard against a benchmark that rotted unseen (a module it imports moved, a
    name it uses renamed): every benchmarks/bench_*.py imports and has its main. The smoke runs
    above run some of them end to end; the rest (S3, Prefect, netns and Ray runs) are heavy."""
    import importlib

    from tests.conftest import ROOT

    names = sorted(
        n[:-3] for n in os.listdir(os.path.join(ROOT, "benchmarks")) if n.startswith("bench_") and n.endswith(".py")
    )
    assert len(names) >= 16
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        assert callable(getattr(module, "main", None)), name
