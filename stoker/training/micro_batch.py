"""train.micro_batch_size 'auto', settled on the ranks at start-up (Composer's automatic
micro-batching, planned first).

The plan (``arithmetic.plan``) gives the largest micro-batch that divides the rank's share of the
global batch and fits the device. On a GPU a probe step confirms it: one forward and backward
of that many random sequences, without the gradient's collective and without an optimizer
step; on an out-of-memory error the next smaller divisor is tried. The ranks then agree on the
smallest value any of them found. The global batch is unchanged (the rest is accumulation),
so the data order and the run are those of the same value set by hand. CPUs raise no
out-of-memory error to probe with: there the plan's value stands.

The probe leaves no trace: every RNG stream is restored, the gradients are dropped, the
weights and the optimizer are untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stoker.arithmetic.plan import GIB, Hardware, auto_micro_batch, hardware_of, micro_batches, peak_flops_of
from stoker.config import RunConfig
from stoker.contracts import events
from stoker.training.engine import Engine, grad_sync


def device_hardware(cfg: RunConfig, device: torch.device) -> Hardware:
    """This rank's device as the plan sees it: a GPU's name and memory from torch; on CPUs,
    the host's memory shared by the ranks the config puts on it."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return Hardware(name, float(total), peak_flops_of(name))
    planned = hardware_of(cfg) if cfg.launch.accelerator is None else None
    return planned if planned is not None and not planned.cuda else Hardware.cpu(cfg.launch.device_memory_gib)


def settle(cfg: RunConfig, model: torch.nn.Module, engine: Engine, vocab_size: int, is_rank0: bool, say) -> RunConfig:
    """`cfg` with train.micro_batch_size a number: itself when it was one; else the plan's
    choice, probed on a GPU and agreed by every rank. `say`: rank 0's event channel."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    hardware = device_hardware(cfg, engine.device)
    planned = auto_micro_batch(cfg, hardware)
    chosen, probed = planned, False
    if engine.device.type == "cuda":
        chosen = _probe(cfg, model, engine, vocab_size, [m for m in micro_batches(cfg) if m <= planned])
        probed = True
    if dist.is_available() and dist.is_initialized():
        box = torch.tensor([chosen], device=engine.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        chosen = int(box.item())
    settled = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": chosen})})
    if is_rank0:
        say(
            events.MicroBatchChosen(
                micro_batch_size=chosen,
                planned=planned,
                probed=probed,
                accum=settled.grad_accum_steps,
                device=hardware.name,
                device_memory_gib=round(hardware.memory_bytes / GIB, 2),
            )
        )
    return settled


def _probe(cfg: RunConfig, model: torch.nn.Module, engine: Engine, vocab_size: int, candidates: list[int]) -> int:
    """The largest candidate whose forward and backward ran without running out of memory
    (the smallest when none did: the step itself then says so). The ranks try the same sizes
    in the same order and agree after each try, so a collective of FSDP2's forward is never
    left waiting for a rank that gave up."""
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state(engine.device)
    generator = torch.Generator(device=engine.device).manual_seed(0)
    T = cfg.model.block_size
    try:
        for m in candidates:
            ok = _fits(model, engine, vocab_size, m, T, generator)
            if dist.is_available() and dist.is_initialized():
                flag = torch.tensor([int(ok)], device=engine.device if dist.get_backend() == "nccl" else "cpu")
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                ok = bool(flag.item())
            if ok:
                return m
        return candidates[-1]
    finally:
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state(cuda_rng, engine.device)


def _fits(model, engine: Engine, vocab_size: int, m: int, T: int, generator: torch.Generator) -> bool:
    idx = torch.randint(0, vocab_size, (m, T + 1), device=engine.device, generator=generator)
    try:
        with grad_sync(model, enabled=False), engine.autocast():
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
