"""The plan's memory estimate (stoker.arithmetic.plan) against torch's memory tracker
(torch.distributed._tools.mem_tracker.MemTracker: every tensor the step allocates, by kind)
for the tiny models on CPU, fp32: two optimizer steps of two accumulated micro-batches. The
GPU check (torch.cuda.max_memory_allocated, GPT-2 124M and a Llama-1B shape) is
benchmarks/bench_plan.py's."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from stoker.arithmetic import plan as plans
from stoker.config import RunConfig
from stoker.training.engine import Engine, build_model, build_optimizer

# the stated error (benchmarks/RESULTS.md#the-plan). The plan errs high: at most 8% above the
# measured peak (the most measured: +7.5%, llama with full checkpointing and the standard loss).
# Never below it with the standard loss; with the chunked one it was measured up to 0.9% low
# (gpt2, selective; gpt2 without checkpointing, below: -0.2%), so there at most 1% below.
MAX_HIGH = 0.08
MAX_LOW_CHUNKED = 0.01


def _peak(cfg: RunConfig, micro: int, accum: int) -> int:
    torch.manual_seed(0)
    engine = Engine.resolve(cfg, torch.device("cpu"))
    vocab = cfg.tokenizer.vocab_size
    raw, model = build_model(cfg, vocab, engine, 1)
    optimizer = build_optimizer(cfg, raw, engine)
    tracker = MemTracker()
    tracker.track_external(raw, optimizer)
    T = cfg.model.block_size
    with tracker:
        for _ in range(2):
            for _ in range(accum):
                idx = torch.randint(0, vocab, (micro, T + 1))
                _, loss = model(idx[:, :-1], idx[:, 1:])
                (loss / accum).backward()
                tracker.reset_mod_stats()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    (device,) = tracker.get_tracker_snapshot("peak")
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


@pytest.mark.parametrize(
    "family,checkpointing,cross_entropy",
    [
        ("llama", "none", "standard"),
        ("llama", "selective", "chunked"),
        ("llama", "full", "standard"),
        ("gpt2", "none", "chunked"),
        ("gpt2", "selective", "standard"),
        ("gpt2", "full", "chunked"),
    ],
)
def test_the_plan_is_within_its_stated_error_of_the_measured_peak(family, checkpointing, cross_entropy):
    cfg = RunConfig(
        model={"family": family, "n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 128},
        tokenizer={"vocab_size": 2048},
        train={"global_batch_size": 8, "micro_batch_size": 4},
        launch={"nproc_per_node": 1},
        engine={"activation_checkpointing": checkpointing, "cross_entropy": cross_entropy, "cross_entropy_chunk": 128},
    )
    measured = _peak(cfg, 4, 2)
    planned = plans.plan(cfg, plans.Hardware.cpu()).allocated
    assert planned <= measured * (1 + MAX_HIGH), (planned, measured, planned / measured)
    low = MAX_LOW_CHUNKED if cross_entropy == "chunked" else 0.0
    assert planned >= measured * (1 - low), (planned, measured, planned / measured)
