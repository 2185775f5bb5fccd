"""The plan of a run before it spends anything: per-device memory, tokens, FLOPs, time and cost.

``plan(cfg, hardware)`` reads only the config (torch-free: the flow, the CLI and preflight
use it before any rank starts) and returns a ``Plan``: per device, the bytes of

- the parameters (fp32 master weights; FSDP2 shards them over every rank),
- FSDP2's gathered working copies (one block and the next, prefetched, in the parameter
  dtype of its mixed-precision policy, plus the root's embedding and output matrix, which
  FSDP2 keeps gathered from the forward to the end of the backward),
- the gradients (fp32, sharded as the parameters; FSDP2's unsharded gradient of a block before
  its reduce-scatter),
- AdamW's state (two fp32 moments per parameter),
- the activations one micro-batch keeps for the backward pass, counted tensor by tensor from
  the family's forward (``_block_saved``) for each activation-checkpointing mode, plus the
  output layer (the whole logits, their fp32 copy and gradient; or one chunk of them under
  the chunked cross-entropy),
- and the allocator's reserve (on CUDA: ``CUDA_CONTEXT_GIB`` for the context and cuBLAS
  workspaces, plus ``FRAGMENTATION`` of the allocated peak; none on CPU).

The peak: weights, working copies and optimizer state, with one micro-batch's activations and
every gradient (gradient accumulation: a second micro-batch's forward runs beside the first's
gradients), or without accumulation the larger of the activations (with the output layer's
gradients, the first made) and the gradients. The estimate is compared with torch's
memory tracker on CPU (``tests/arithmetic/test_plan.py``) and with ``torch.cuda.max_memory_allocated``
on a GPU (``benchmarks/bench_plan.py``); the error is in benchmarks/RESULTS.md.

The time: tokens per step x the model's training FLOPs per token (6N + attention, as the
families' ``flops_per_token``) over the devices' bf16 peak at a stated MFU; the cost from
``cost.per_accelerator_hour``.

A config that does not fit is refused before launch (``fit_problem``, used by preflight) in one
line naming the cheapest fix that makes it fit: a smaller micro-batch (same global batch, more
accumulation), then activation checkpointing, then FSDP, then more devices.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from stoker.arithmetic.learning_rate import effective_train
from stoker.arithmetic.learning_rate import origin as lr_origin
from stoker.arithmetic.schedule import describe as describe_schedule

GIB = 1024**3
CUDA_CONTEXT_GIB = 1.0  # the CUDA context, cuBLAS/cuDNN workspaces: outside max_memory_allocated
FRAGMENTATION = 0.10  # the caching allocator's blocks beyond what is allocated at the peak
DEFAULT_MFU = 0.40  # what bench_gpu measured for GPT-2 124M on one H100 (benchmarks/RESULTS.md)

# dense bf16 tensor-core peak per device (no sparsity: half NVIDIA's datasheet figure "with
# sparsity"), by a substring of the device name; the first match wins, so the PCIe and NVL
# boards (lower clocks and power) come before the SXM name they contain. torch names them e.g.
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200".
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),  # datasheet 1,513 sparse
    ("H100 NVL", 835e12),  # 1,671 sparse (per GPU; older sheets gave 3,958 for the pair)
    ("H200 NVL", 835e12),  # 1,671 sparse
    ("H800 PCIe", 756e12),  # 1,513 sparse
    ("GH200", 989e12),
    ("H200", 989e12),  # SXM: 1,979 sparse
    ("H100", 989e12),  # SXM: 1,979 sparse
    ("H800", 989e12),  # SXM
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)

# memory per device (GiB, as the board's name says it) of the accelerators launch.accelerator
# names; a name not here needs launch.device_memory_gib
DEVICE_MEMORY_GIB = (
    ("H200 NVL", 141.0),
    ("GH200", 96.0),
    ("H200", 141.0),
    ("H100 NVL", 94.0),
    ("H100", 80.0),
    ("H800", 80.0),
    ("A100-40", 40.0),
    ("A100 40", 40.0),
    ("A100", 80.0),
    ("A800", 80.0),
    ("L40S", 48.0),
    ("A10G", 24.0),
)


def peak_flops_of(device_name: str) -> float | None:
    """Peak bf16 FLOP/s of a CUDA device by its name (torch.cuda.get_device_name)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key.lower() in device_name.lower()), None)


@dataclass(frozen=True)
class Hardware:
    """One device of the run: its name, its memory and its bf16 peak (None: unknown, no time)."""

    name: str
    memory_bytes: float
    peak_flops: float | None
    cuda: bool = True

    @classmethod
    def named(cls, name: str, memory_gib: float | None = None) -> "Hardware":
        """A GPU by its name ('H100', 'NVIDIA H200', 'A100-40GB'); memory_gib overrides the
        table (a board it does not know needs it)."""
        if name.lower() == "cpu":
            return cls.cpu(memory_gib)
        if memory_gib is None:
            memory_gib = next((gib for key, gib in DEVICE_MEMORY_GIB if key.lower() in name.lower()), None)
        if memory_gib is None:
            known = ", ".join(dict.fromkeys(k.split()[0].split("-")[0] for k, _ in DEVICE_MEMORY_GIB))
            raise ValueError(
                f"launch.accelerator: {name!r} is not a device whose memory stoker knows ({known}); "
                "give its memory in launch.device_memory_gib"
            )
        return cls(name, memory_gib * GIB, peak_flops_of(name))

    @classmethod
    def cpu(cls, memory_gib: float | None = None) -> "Hardware":
        """This host's CPUs: its memory (MemTotal) unless given."""
        if memory_gib is None:
            memory_gib = _host_memory_bytes() / GIB
        return cls("cpu", memory_gib * GIB, None, cuda=False)


def _host_memory_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def local_gpu_name(proc: str = NVIDIA_PROC) -> str | None:
    """The model of this host's first NVIDIA GPU, from the driver's /proc files (no torch, no
    CUDA context): e.g. 'NVIDIA H100 80GB HBM3'; None without one."""
    try:
        buses = sorted(os.listdir(proc))
    except OSError:
        return None
    for bus in buses:
        try:
            with open(os.path.join(proc, bus, "information")) as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            continue
    return None


def hardware_of(cfg: Any) -> Hardware:
    """The run's device: launch.accelerator (with launch.device_memory_gib), else this host's
    GPU, else this host's CPUs, their memory shared by the ranks the config puts here."""
    lc = cfg.launch
    if lc.accelerator:
        return Hardware.named(lc.accelerator, lc.device_memory_gib)
    name = local_gpu_name()
    if name:
        return Hardware.named(name, lc.device_memory_gib)
    if lc.device_memory_gib:
        return Hardware.cpu(lc.device_memory_gib)
    here = lc.nproc_per_node * (1 if lc.nodes else lc.num_nodes)
    share = Hardware.cpu()
    return Hardware(f"cpu (1/{here} of this host)", share.memory_bytes / here, None, cuda=False)


# ---- the model's shape, from the config alone -------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the plan reads of a model, filled by its family's config section
    (``families/<name>/config.py``: ``plan_shape``): parameters by part, the widths FLOPs count, and
    the widths of what one block keeps per token for its backward pass, counted tensor by
    tensor from the family's forward (``stoker.families``)."""

    layers: int
    width: int  # C
    vocab: int  # embedding rows
    block: int  # T
    block_params: int  # one block's parameters
    root_params: int  # everything outside the blocks (embeddings, final norm, an untied output)
    matmul_params: int  # N of the 6N FLOPs a token (the family's flops_per_token)
    attention_width: int  # the query width of 12·L·width·T
    saved_fp32: int  # kept in fp32 whatever the autocast: the norms' inputs (and RMSNorm's value)
    matmul_inputs_fp32: int  # the matmuls' inputs under fp32 (one tensor where several share it)
    matmul_inputs_bf16: int  # under bf16 autocast each matmul casts (and keeps) its own copy
    saved_matmul: int  # kept in the matmul dtype: projections' outputs, attention's q, k, v, out
    kept_selective: int  # what selective checkpointing keeps (matmul and attention outputs)
    final_norm_fp32: int  # what the final norm keeps, per token
    # a mixture of experts (families.moe_section): the parameters a token runs, the experts'
    # parameters, experts per sparse layer, top-k and the sparse layers; 0 for a dense model
    active_params: int = 0
    expert_params: int = 0
    experts: int = 0
    top_k: int = 0
    sparse_layers: int = 0

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params


def vocab_rows(cfg: Any) -> int:
    """The embedding rows: a base's own count (model.vocab_size), else the tokenizer's size
    padded to model.vocab_pad_multiple."""
    m = cfg.model
    if getattr(m, "vocab_size", None):
        return m.vocab_size
    multiple = m.vocab_pad_multiple
    return -(-cfg.tokenizer.vocab_size // multiple) * multiple


def shape_of(cfg: Any) -> Shape:
    return Shape(**cfg.model.plan_shape(vocab_rows(cfg)))


def _block_saved(s: Shape, a: int, bf16: bool) -> dict[str, float]:
    """Bytes per token one block keeps for its backward pass, by checkpointing mode. `a`: the
    bytes of a matmul's output (2 under bf16 autocast, else 4); the residual stream and the
    norms stay fp32."""
    inputs = s.matmul_inputs_bf16 * 2 if bf16 else s.matmul_inputs_fp32 * 4
    none = s.saved_fp32 * 4 + inputs + s.saved_matmul * a
    return {"none": none, "selective": s.kept_selective * a + s.width * 4, "full": s.width * 4}


def _output_bytes(s: Shape, tokens: int, a: int, chunk: int) -> float:
    """The output layer of one micro-batch at its peak (the backward of the cross-entropy):
    the final norm's saved tensors, then the logits in the matmul dtype, their fp32 copy (the
    loss reads fp32; the same tensor under fp32), log-softmax's output and its gradient.
    Chunked (families.layers._ChunkedCrossEntropy): the gradients made in the forward pass (of
    h, and the fp32 one of the output matrix) and one chunk at a time: its logits in the matmul
    dtype, their fp32 copy (none under fp32: the same tensor), the softmax and its scaled copy;
    or, later in the chunk, the logits, the scaled softmax and the output matrix's gradient of
    the chunk before it is added."""
    V, C = s.vocab, s.width
    norm = s.final_norm_fp32 * 4 * tokens
    if chunk:
        rows = min(chunk, tokens)
        logits = rows * V * (a + (4 if a != 4 else 0))
        peak = max(logits + rows * V * 8, logits + rows * V * 4 + V * C * 4)
        return norm + tokens * C * a + V * C * 4 + peak
    # fp32: the logits, log-softmax's output, its gradient, the logits' gradient; bf16: the
    # logits and their gradient in bf16, the fp32 copy, log-softmax's output and gradient
    copies = 16
    return norm + tokens * V * copies


@dataclass
class Plan:
    """One configuration's plan; bytes are per device."""

    parallelism: str
    world: int
    micro_batch: int
    accum: int
    activation_checkpointing: str
    cross_entropy_chunk: int
    hardware: Hardware | None
    params: int
    weights: float
    working: float  # FSDP2's gathered copies
    grads: float
    optimizer: float
    activations: float
    reserve: float = 0.0
    root_grads: float = 0.0  # the gradients of what is outside the blocks (the output layer's)
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    mfu: float = DEFAULT_MFU
    max_steps: int = 0
    price: float | None = None
    notes: list[str] = field(default_factory=list)
    schedule: str = ""  # the learning rate over the run's steps (arithmetic.schedule.describe)
    lr_origin: str = ""  # where a run from a base takes its train.lr (arithmetic.learning_rate.origin)
    data_mix: str = ""  # a mixture's weights over the run's steps
    branch: str = ""  # where a branch leaves its parent
    active_params: int = 0  # a mixture's parameters a token runs (0: dense)
    experts: str = ""  # a mixture's experts, as the plan says them
    all_to_all: float = 0.0  # a mixture's bytes sent by each device per step (expert parallel)

    @property
    def allocated(self) -> float:
        """The allocated peak (what torch.cuda.max_memory_allocated reads). With accumulation
        a micro-batch's activations and the gradients of the last exist together; without,
        the gradients are made as the activations are freed: the peak is the larger of the
        activations with the output layer's gradients (the first made), and all gradients."""
        at_peak = (
            self.activations + self.grads if self.accum > 1 else max(self.activations + self.root_grads, self.grads)
        )
        return self.weights + self.working + self.optimizer + at_peak

    @property
    def total(self) -> float:
        return self.allocated + self.reserve

    @property
    def fits(self) -> bool:
        return self.hardware is None or self.total <= self.hardware.memory_bytes

    @property
    def step_seconds(self) -> float | None:
        if self.hardware is None or not self.hardware.peak_flops:
            return None
        return self.tokens_per_step * self.flops_per_token / (self.world * self.hardware.peak_flops * self.mfu)

    @property
    def wall_seconds(self) -> float | None:
        step = self.step_seconds
        return None if step is None else step * self.max_steps

    @property
    def cost(self) -> float | None:
        wall = self.wall_seconds
        if wall is None or not self.price:
            return None
        return wall / 3600 * self.world * self.price

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) lines of the plan's table."""
        hw = self.hardware
        out = [
            ("parallelism", f"{self.parallelism} on {self.world} device(s)"),
            ("micro-batch x accumulation", f"{self.micro_batch} x {self.accum}"),
            ("activation checkpointing", self.activation_checkpointing),
            (
                "cross-entropy",
                f"chunked, {self.cross_entropy_chunk} tokens" if self.cross_entropy_chunk else "standard",
            ),
            ("parameters", f"{self.params / 1e6:,.1f} M"),
            *([("active parameters", f"{self.active_params / 1e6:,.1f} M a token")] if self.active_params else []),
            *([("experts", self.experts)] if self.experts else []),
            *([("all-to-all per step", _gib(self.all_to_all) + " sent by each device")] if self.all_to_all else []),
            ("weights (fp32)", _gib(self.weights)),
            ("FSDP gathered blocks", _gib(self.working)),
            ("gradients (fp32)", _gib(self.grads)),
            ("optimizer (AdamW, fp32)", _gib(self.optimizer)),
            ("activations (one micro-batch)", _gib(self.activations)),
            ("allocator reserve", _gib(self.reserve)),
            ("total per device", _gib(self.total) + (f" of {_gib(hw.memory_bytes)} ({hw.name})" if hw else "")),
            ("fits", "yes" if self.fits else "NO"),
            ("tokens per step", f"{self.tokens_per_step:,}"),
            ("FLOPs per token", f"{self.flops_per_token:.3g}"),
        ]
        if self.step_seconds is not None:
            out.append(("step time", f"{self.step_seconds:.3g} s at {self.mfu:.0%} MFU"))
            out.append(("wall time", f"{self.wall_seconds / 3600:,.2f} h for {self.max_steps:,} steps"))
        if self.cost is not None:
            out.append(("cost", f"{self.cost:,.2f} ({self.world} x {self.price} an accelerator-hour)"))
        out += [
            (what, value)
            for what, value in (
                ("learning rate", self.schedule),
                ("learning rate from", self.lr_origin),
                ("data mix", self.data_mix),
                ("branch", self.branch),
            )
            if value
        ]
        return out

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in self.rows())

    def to_dict(self) -> dict:
        return {
            "parallelism": self.parallelism,
            "world": self.world,
            "micro_batch": self.micro_batch,
            "accum": self.accum,
            "activation_checkpointing": self.activation_checkpointing,
            "hardware": self.hardware.name if self.hardware else None,
            "device_memory_gib": round(self.hardware.memory_bytes / GIB, 2) if self.hardware else None,
            "params": self.params,
            "active_params": self.active_params or self.params,
            "all_to_all_gib": round(self.all_to_all / GIB, 4),
            **{k: round(getattr(self, k) / GIB, 4) for k in _PARTS},
            "allocated_gib": round(self.allocated / GIB, 4),
            "total_gib": round(self.total / GIB, 4),
            "fits": self.fits,
            "tokens_per_step": self.tokens_per_step,
            "flops_per_token": self.flops_per_token,
            "step_seconds": self.step_seconds,
            "wall_seconds": self.wall_seconds,
            "cost": self.cost,
        }


_PARTS = ("weights", "working", "grads", "optimizer", "activations", "reserve")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 100 else f"{n / 1024**2:,.1f} MiB"


def plan(
    cfg: Any,
    hardware: Hardware | None = None,
    *,
    micro_batch: int | None = None,
    activation_checkpointing: str | None = None,
    parallelism: str | None = None,
    world: int | None = None,
    mfu: float = DEFAULT_MFU,
) -> Plan:
    """The plan of `cfg` on `hardware` (each keyword: another choice than the config's)."""
    e = cfg.engine
    s = shape_of(cfg)
    world = world or cfg.launch.world_size
    parallelism = parallelism or e.parallelism
    ac = activation_checkpointing or e.activation_checkpointing
    tp = cfg.engine.tp_degree if parallelism == "fsdp+tp" else 1
    dp = max(1, world // tp)
    micro = micro_batch or (cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1)
    accum = max(1, cfg.train.global_batch_size // (dp * micro))
    cuda = hardware.cuda if hardware is not None else True
    bf16 = e.precision == "bf16" or (e.precision == "auto" and cuda)
    a = 2 if bf16 else 4
    chunk = e.cross_entropy_chunk if e.cross_entropy == "chunked" else 0
    n = s.params
    sharded = parallelism in ("fsdp", "fsdp+tp")
    shard = world if sharded else 1
    weights, grads, optimizer = 4 * n / shard, 4 * n / shard, 8 * n / shard
    working = 0.0
    ep = getattr(e, "ep_degree", 1) if parallelism == "fsdp" and s.experts else 1
    # under expert parallel a block's experts are gathered over world / ep ranks only: a device
    # holds E / ep of them whole
    block = s.block_params - (s.expert_params / s.layers) * (1 - 1 / ep) if ep > 1 else s.block_params
    if sharded:  # a block gathered and the next prefetched, the root kept gathered; grads too
        gathered = (2 * block + s.root_params) / tp
        working = gathered * a + (block + s.root_params) / tp * 4
    tokens = micro * s.block
    per_token = _block_saved(s, a, bf16)
    acts = s.layers * tokens * per_token[ac] / tp
    if ac != "none":  # the block recomputed in the backward pass, half of what it drops at
        # a time on average as its backward frees them (measured: tests/arithmetic/test_plan.py)
        acts += tokens * (per_token["none"] - per_token[ac]) / 2 / tp
    # the embedding's output (the first block's input) and the output layer; under tensor
    # parallel the sequence is split over the group, and the loss is vocabulary-parallel
    acts += (tokens * s.width * 4 + _output_bytes(s, tokens, a, chunk)) / tp
    p = Plan(
        parallelism=parallelism,
        world=world,
        micro_batch=micro,
        accum=accum,
        activation_checkpointing=ac,
        cross_entropy_chunk=chunk,
        hardware=hardware,
        params=n,
        weights=weights,
        working=working,
        grads=grads,
        optimizer=optimizer,
        activations=acts,
        root_grads=4 * s.root_params / shard,
        tokens_per_step=cfg.train.global_batch_size * s.block,
        flops_per_token=cfg.model.flops_per_token(vocab_rows(cfg)),
        mfu=mfu,
        max_steps=cfg.train.max_steps,
        price=getattr(getattr(cfg, "cost", None), "per_accelerator_hour", None),
        schedule=describe_schedule(effective_train(cfg)),
        lr_origin=lr_origin(cfg),
        data_mix=mix_over_steps(cfg),
        branch=f"from {cfg.train.branch_from}" if getattr(cfg.train, "branch_from", None) else "",
        active_params=s.active_params,
        experts=_experts_line(s, ep),
        # each token's k copies sent to their experts' ranks and back, in the forward and the
        # backward pass, at every sparse layer: the (ep - 1) / ep of them bound for other ranks
        all_to_all=(
            4
            * (cfg.train.global_batch_size * s.block / world)
            * s.top_k
            * s.width
            * a
            * s.sparse_layers
            * (ep - 1)
            / ep
        ),
    )
    if cuda:
        p.reserve = CUDA_CONTEXT_GIB * GIB + FRAGMENTATION * p.allocated
    return p


def _experts_line(s: Shape, ep: int) -> str:
    if not s.experts:
        return ""
    split = f"; {ep} ranks a group (engine.ep_degree): {s.experts // ep} experts a device" if ep > 1 else ""
    return f"{s.experts} a sparse layer in {s.sparse_layers} of {s.layers} layers, top-{s.top_k}{split}"


def micro_batches(cfg: Any) -> list[int]:
    """The micro-batches that keep the global batch: divisors of global / data-parallel size,
    largest first."""
    per_rank = cfg.train.global_batch_size // cfg.data_parallel_size
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def auto_micro_batch(cfg: Any, hardware: Hardware | None) -> int:
    """train.micro_batch_size 'auto': the largest micro-batch that keeps the global batch
    (through accumulation) and fits `hardware` by the plan; 1 when none fits (the refusal is
    fit_problem's). Without hardware: the config's own value if it is a number, else 1."""
    if hardware is None:
        m = cfg.train.micro_batch_size
        return m if isinstance(m, int) else 1
    for m in micro_batches(cfg):
        if plan(cfg, hardware, micro_batch=m).fits:
            return m
    return 1


def fit_problem(cfg: Any, hardware: Hardware | None) -> str | None:
    """One line when `cfg` does not fit `hardware` by the plan, naming the cheapest fix (the
    first that fits, in this order: a smaller micro-batch, activation checkpointing, the
    chunked cross-entropy, FSDP, more devices); None when it fits or nothing is known."""
    if hardware is None:
        return None
    auto = not isinstance(cfg.train.micro_batch_size, int)
    m = auto_micro_batch(cfg, hardware) if auto else cfg.train.micro_batch_size
    p = plan(cfg, hardware, micro_batch=m)
    if p.fits:
        return None
    need = (
        f"the plan of this run needs {_gib(p.total)} per device and {hardware.name} has {_gib(hardware.memory_bytes)}"
    )
    where, fix = _cheapest_fix(cfg, hardware, auto)
    return f"{where}: {need} (stoker plan shows the parts); {fix}"


def _cheapest_fix(cfg: Any, hw: Hardware, auto: bool) -> tuple[str, str]:
    """(the field to change, how), the first of these that fits: a smaller micro-batch,
    activation checkpointing, the chunked cross-entropy, FSDP, more devices."""
    e = cfg.engine
    if not auto:
        for m in micro_batches(cfg):
            if m < cfg.train.micro_batch_size and plan(cfg, hw, micro_batch=m).fits:
                return "train.micro_batch_size", f"use {m} (or 'auto'): the global batch stays, by accumulation"
    smallest = 1
    for ac in ("selective", "full"):
        if (
            _rank(ac) > _rank(e.activation_checkpointing)
            and plan(cfg, hw, micro_batch=smallest, activation_checkpointing=ac).fits
        ):
            return "engine.activation_checkpointing", f"set it to '{ac}', with train.micro_batch_size 'auto'"
    if e.cross_entropy != "chunked":
        chunked = cfg.model_copy(update={"engine": e.model_copy(update={"cross_entropy": "chunked"})})
        if plan(chunked, hw, micro_batch=smallest, activation_checkpointing="full").fits:
            return "engine.cross_entropy", "set it to 'chunked', with engine.activation_checkpointing 'full'"
    if e.parallelism == "ddp" and cfg.launch.world_size > 1:
        for ac in ("none", "selective", "full"):
            if plan(cfg, hw, micro_batch=smallest, activation_checkpointing=ac, parallelism="fsdp").fits:
                extra = "" if ac == "none" else f", with engine.activation_checkpointing '{ac}'"
                return (
                    "engine.parallelism",
                    f"set it to 'fsdp'{extra}: it shards weights, gradients and optimizer state",
                )
    sharded = "fsdp" if e.parallelism == "ddp" else e.parallelism
    for world in (2**k for k in range(1, 15)):
        if world <= cfg.launch.world_size:
            continue
        if plan(cfg, hw, micro_batch=smallest, activation_checkpointing="full", parallelism=sharded, world=world).fits:
            nodes = math.ceil(world / cfg.launch.nproc_per_node)
            return "launch.num_nodes", (
                f"shard it over {world} devices: num_nodes {nodes} x nproc_per_node "
                f"{cfg.launch.nproc_per_node}, with engine.parallelism '{sharded}' and activation "
                "checkpointing 'full'"
            )
    return "launch.accelerator", "it fits on no number of these devices: use devices with more memory"


def _rank(ac: str) -> int:
    return ("none", "selective", "full").index(ac)


def plans_by_parallelism(cfg: Any, hardware: Hardware | None, mfu: float = DEFAULT_MFU) -> list[Plan]:
    """The config's plan and, beside it, the other parallelisms the run could use (at the
    same micro-batch: 'auto' is settled for the config's own)."""
    auto = not isinstance(cfg.train.micro_batch_size, int)
    m = auto_micro_batch(cfg, hardware) if auto else cfg.train.micro_batch_size
    out = [plan(cfg, hardware, micro_batch=m, mfu=mfu)]
    for other in ("ddp", "fsdp"):
        if other == cfg.engine.parallelism:
            continue
        alt = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"parallelism": other, "tp_degree": 1})})
        out.append(plan(alt, hardware, micro_batch=auto_micro_batch(alt, hardware) if auto else m, mfu=mfu))
    return out


__all__ = ["Hardware", "Plan", "auto_micro_batch", "fit_problem", "hardware_of", "plan", "plans_by_parallelism"]


def mix_over_steps(cfg: Any) -> str:
    """A mixture's weights and where data.schedule changes them, in a line ('' for one source)."""
    sources = getattr(cfg.data, "sources", None) or []
    if not sources:
        return ""
    text = "from step 0: " + ", ".join(f"{s.name} {s.weight:g}" for s in sources)
    for change in getattr(cfg.data, "schedule", None) or []:
        text += f"; from step {change.at_step}: " + ", ".join(f"{n} {w:g}" for n, w in change.weights.items())
    return text
