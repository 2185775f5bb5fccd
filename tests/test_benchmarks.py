"""Smoke runs of the benchmarks (`--smoke`: a tiny size that goes through every part of one, its
ratio lines included), so none breaks unseen. Their figures mean nothing; that each runs and
prints its figures and ratios, and what it leaves behind, are checked. bench_flow, bench_resume
and bench_multinode have a --smoke too, but no test here: each is torchrun gangs (and, for
bench_flow, evaluation processes and a flow) costing over 40 s on a 2-core host.

The GPU benchmark cannot run in CI (no GPU), so its smoke run does: every part of
benchmarks/bench_gpu.py (explore, ours against the bare loop, the kernel profile, the
checkpoint stall) at a tiny size on the CPU, so a lent GPU's minutes are not spent finding a
broken benchmark."""

import glob
import logging
import math
import os
import re

import pytest

from tests.conftest import prepare_shards


@pytest.fixture
def bench_process_state():
    """A benchmark's main() run in the test's process may set what a process of its own would:
    environment variables (STOKER_CACHE, STOKER_CPU_THREADS, AWS keys), torch's thread count,
    Prefect's log level. All of it is put back afterwards, for the tests after it. (A session
    fixture a test names, s3_server's AWS keys say, is set up before this one: kept.)"""
    import torch

    environ, threads = dict(os.environ), torch.get_num_threads()
    prefect_level = logging.getLogger("prefect").level
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        logging.getLogger("prefect").setLevel(prefect_level)


def _figures(pattern: str, out: str) -> list[float]:
    """Every number `pattern`'s group 1 matches in `out`, asserted found and finite."""
    found = [float(x) for x in re.findall(pattern, out)]
    assert found and all(math.isfinite(x) for x in found), (pattern, out)
    return found


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
    and the ratio lines (bytecode, quick_exit) are printed; their figures mean nothing at this
    size."""
    from benchmarks import bench_startup

    bench_startup.main(["--module", "stoker.failures", "--reps", "1", "--reference", ""])
    out = capsys.readouterr().out
    assert "import stoker.failures:" in out and "compiled (medians of 1)" in out
    assert "RATIO compiled / from source CPU-s = " in out
    assert "then its exit:" in out and "RATIO quick_exit / normal exit CPU-s = " in out


def test_bench_mixture_smoke_run_prints_its_ratio(capsys):
    """benchmarks/bench_mixture.py at a tiny size: three sources against one, both read."""
    from benchmarks import bench_mixture

    result = bench_mixture.main(["--smoke"])
    assert result["one_source_ms_per_step"] > 0 and result["three_sources_ms_per_step"] > 0
    assert "(exact)" in result["mixture"][0]
    assert "RATIO three sources / one source" in capsys.readouterr().out


def test_bench_data_order_smoke_run_measures_both_sizes_in_fresh_processes(capsys):
    """benchmarks/bench_data_order.py at a tiny size: the peak RSS of a child at 1e6 and at 1e10
    windows per source (the computed order: within 1 MB even here), and the speed ratio against
    the stored permutations it replaced."""
    from benchmarks import bench_data_order

    result = bench_data_order.main(["--smoke"])
    out = capsys.readouterr().out
    assert abs(result["peak_rss_difference_mb"]) <= 1, result
    assert _figures(r"RATIO computed / stored order, picks per second at 1e6 windows: ([\d.]+)", out)[0] > 0


def test_bench_data_smoke_run_counts_the_same_tokens_three_ways(capsys):
    """benchmarks/bench_data.py on a tiny corpus: the data stage, encode_batch_fast and
    Dataset.map count the same tokens (its report asserts it), every ratio printed."""
    from benchmarks import bench_data

    bench_data.main(["--smoke"])
    out = capsys.readouterr().out
    assert "tokenize+shard tok/CPU-s / raw encode_batch_fast" in out and "all hits: True" in out


def test_bench_ledger_smoke_run_accounts_a_restart_and_prints_its_ratio(bench_process_state, capsys):
    """benchmarks/bench_ledger.py on a synthetic run of 2,000 steps: killed at step 1,700 (60%
    + 500), resumed from its commit of step 1,000, so the ledger counts 700 steps lost."""
    from benchmarks import bench_ledger

    bench_ledger.main(["--smoke"])
    out = capsys.readouterr().out
    assert "ledger of 2000 steps" in out and "700 steps lost" in out, out
    (goodput,) = _figures(r"goodput ([\d.]+)", out)
    assert 0 < goodput < 1, out
    assert _figures(r"RATIO ledger / training = ([\d.e+-]+)", out)[0] > 0


def test_bench_memory_smoke_run_measures_every_variant_against_none(bench_process_state, capsys):
    """benchmarks/bench_memory.py at its smallest shape (one head: width 64): every variant's
    memory and time ratios to 'none', 'none' itself at 1.00."""
    from benchmarks import bench_memory

    bench_memory.main(["--smoke"])
    out = capsys.readouterr().out
    assert "1 layers x 64, block 32, batch 2, vocab 256, chunk 16, on cpu" in out, out
    for variant in bench_memory.VARIANTS:
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{variant}:"))
        assert line.count("RATIO") == 3 and _figures(r"activations +([\d.]+) MiB", line)[0] > 0, line
    none = next(line for line in out.splitlines() if line.strip().startswith("none:"))
    assert _figures(r"RATIO[a-z ]* ([\d.]+)", none) == [1.0, 1.0, 1.0], none


def test_bench_plan_smoke_run_compares_the_plan_with_the_memory_tracker(bench_process_state, capsys):
    """benchmarks/bench_plan.py on CPU: the tiny GPT-2 and Llama against MemTracker, each
    within the plan's stated error, and the worst ratio printed."""
    from benchmarks import bench_plan

    assert bench_plan.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    errors = _figures(r"\(([-+][\d.]+)%\)", out)
    assert len(errors) == 2 and all(abs(e) <= 10 for e in errors), out
    (worst,) = _figures(r"RATIO plan/measured, worst of 2: ([\d.]+)", out)
    assert 0.9 <= worst <= 1.1, out


def test_bench_eval_sets_smoke_run_times_every_set_against_the_loss(bench_process_state, capsys):
    """benchmarks/bench_eval_sets.py on 2 multiple-choice items and 8 windows, one round."""
    from benchmarks import bench_eval_sets

    bench_eval_sets.main(["--smoke"])
    out = capsys.readouterr().out
    assert "tiny-cpu model, 8 windows, 2 multiple-choice items, 1 rounds" in out, out
    for name in ("loss", "loss+bpb", "mc"):
        assert re.search(rf"^  {re.escape(name)} +[\d.]+ s +x[\d.]+ of 'loss'$", out, re.M), (name, out)
    assert _figures(r"  loss +[\d.]+ s +x([\d.]+) of 'loss'", out) == [1.0]


def test_bench_workers_smoke_run_tokenizes_both_ways_and_prints_its_ratio(bench_process_state, capsys):
    """benchmarks/bench_workers.py on a 300 KB corpus: one build in-process, one in processes."""
    from benchmarks import bench_workers

    bench_workers.main(["--smoke"])
    out = capsys.readouterr().out
    assert _figures(r"(\d+) tokens on \d+ cores", out)[0] > 0
    assert _figures(r"RATIO \d+ processes / 1 worker wall time = ([\d.]+)", out)[0] > 0


def test_bench_checkpoint_smoke_run_saves_both_ways_and_prints_both_ratios(s3_server, bench_process_state, capsys):
    """benchmarks/bench_checkpoint.py with a one-layer model on the session's S3 endpoint: one
    checkpoint async and one sync, then the writer against a plain put."""
    from benchmarks import bench_checkpoint

    affinity = os.sched_getaffinity(0)
    bench_checkpoint.main(["--smoke", "--endpoint", s3_server.url])
    out = capsys.readouterr().out
    assert os.sched_getaffinity(0) == affinity  # the smoke run pins no core of the test's process
    assert "for 4 steps" in out and "(1 checkpoints each)" in out, out
    assert _figures(r"time lost per checkpoint: async [\d.]+s, sync ([\d.]+)s", out)[0] > 0  # a sync save waits
    assert _figures(r"RATIO async/sync time lost per checkpoint = ([\d.]+)", out)[0] >= 0
    assert _figures(r"writer \(stage\+checksum\+upload\+commit\) ([\d.]+)s", out)[0] > 0
    assert _figures(r"RATIO writer/plain upload throughput = ([\d.]+)", out)[0] > 0


def test_bench_events_smoke_run_on_the_session_server_prints_every_ratio(prefect_server, bench_process_state, capsys):
    """benchmarks/bench_events.py on the session's Prefect server: one timed step, five events
    of each kind sent and counted, a ratio for each heartbeat interval."""
    from prefect.events.worker import EventsWorker

    from benchmarks import bench_events

    try:
        bench_events.main(["--smoke", "--on-current-server"])
    finally:
        EventsWorker.drain_all(timeout=30)  # one per process: sent, and none left for the tests after
    out = capsys.readouterr().out
    found = re.search(
        r"tiny-cpu step ([\d.]+) ms CPU; sink call (\d+) ns; one heartbeat (\d+) us CPU; "
        r"one checkpoint event (\d+) us CPU",
        out,
    )
    assert found, out
    step, sink, beat, ckpt = (float(x) for x in found.groups())
    assert step > 0 and sink > 0 and beat > 0 and ckpt > 0, out
    ratios = _figures(r"RATIO event cost / step time, [^:]+: ([\d.]+)%", out)
    assert len(ratios) == 3 and ratios[0] <= ratios[1] <= ratios[2], out


def test_bench_load_smoke_run_reads_half_the_base_on_each_rank(bench_process_state, capsys):
    """benchmarks/bench_load.py on a tiny Llama-shaped base, two gloo ranks: each rank reads its
    half of the base, every figure and the time ratio are printed."""
    from benchmarks import bench_load

    bench_load.main(["--smoke"])
    out = capsys.readouterr().out
    assert _figures(r"each rank read ([\d.]+), [\d.]+ of it", out) + _figures(
        r"each rank read [\d.]+, ([\d.]+) of it", out
    ) == [0.5, 0.5], out
    assert _figures(r"fixed overhead of a rank .*: (\d+) MB", out)[0] > 0
    assert _figures(r"peak RSS above it / model bytes: ([\d.]+)", out)[0] > 0
    assert _figures(r"sharded load [\d.]+ s / plain read [\d.]+ s = ([\d.]+)", out)[0] > 0


def test_bench_ray_data_smoke_run_on_the_session_cluster_builds_the_same_shards(
    ray_cluster, bench_process_state, capsys
):
    """benchmarks/bench_ray_data.py at a tiny size, both Ray columns on the session's two-node
    cluster: the local and the Ray builds make the same shard files (asserted inside), and
    both ratio lines are printed."""
    from benchmarks import bench_ray_data

    bench_ray_data.main(["--smoke", "--store", "file"], cluster=ray_cluster.cluster)
    out = capsys.readouterr().out
    assert "identical shard files in all 3 builds" in out, out
    assert _figures(r"tokens/CPU-s, ray engine \(2 nodes, whole cluster\) / local engine +([\d.]+)", out)[0] > 0
    assert _figures(r"ray engine wall time, 1 node / 2 nodes \(1 CPU each\) +([\d.]+)", out)[0] > 0


def test_every_benchmark_imports_and_has_a_main():
    """The cheapest guard against a benchmark that rotted unseen (a module it imports moved, a
    name it uses renamed): every benchmarks/bench_*.py imports and has its main. The smoke runs
    above run all but three of them end to end (see the module's docstring)."""
    import importlib

    from tests.conftest import ROOT

    names = sorted(
        n[:-3] for n in os.listdir(os.path.join(ROOT, "benchmarks")) if n.startswith("bench_") and n.endswith(".py")
    )
    assert len(names) >= 16
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        assert callable(getattr(module, "main", None)), name


def test_bench_attention_smoke_run_prints_document_over_causal(capsys):
    """benchmarks/bench_attention.py at a tiny size: both attentions train on the same packed
    windows, and the ratio line is printed."""
    from benchmarks import bench_attention

    result = bench_attention.main(["--smoke"])
    out = capsys.readouterr().out
    assert result["smoke"] and set(result["tokens_per_s"]) == {"causal", "document"}
    assert "document attention: " in out and " of causal (SDPA, dense boolean mask, cpu)" in out


def test_bench_moe_smoke_run_prints_its_ratios(capsys):
    """benchmarks/bench_moe.py at a tiny size: the mixture (grouped and loop) and the dense
    model of the same active parameters all train; the ratios are printed."""
    from benchmarks import bench_moe

    out = bench_moe.main(["--smoke"])
    assert out["grouped_over_loop"] > 0 and out["moe_over_dense"] > 0
    assert abs(out["moe_active_params"] - out["dense_params"]) / out["dense_params"] < 0.01
    assert "grouped / loop:" in capsys.readouterr().out


def test_bench_download_smoke_run_reads_ahead_to_the_same_dataset(capsys, monkeypatch):
    """benchmarks/bench_download.py on a tiny folder: one reader and the read ahead by worker
    processes make the same fingerprint (asserted by the benchmark), and its ratio is printed."""
    from benchmarks import bench_download
    from stoker.data import units

    streamed = []
    real = units.stream_units
    monkeypatch.setattr(units, "stream_units", lambda u, *a, **k: streamed.append(len(u)) or real(u, *a, **k))
    result = bench_download.main(["--smoke"])
    out = capsys.readouterr().out
    assert streamed == [4] and result["speedup"] > 0
    assert _figures(r"ratio one reader / read ahead: ([\d.]+) \(the same fingerprint\)", out)[0] > 0
    peaks = bench_download.memory(3, 2)  # the 1x and 10x peaks, one reader and read ahead
    assert sorted(peaks) == ["30x1", "30x2", "3x1", "3x2"] and all(v > 0 for v in peaks.values())
    assert len(_figures(r"ratio 10x / 1x ([\d.]+)", capsys.readouterr().out)) == 2
