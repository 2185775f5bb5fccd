"""How a rank computes: device, precision, compilation, parallelism, optimizer, throughput.

``Engine.resolve`` turns the config's ``engine`` section and the device into decisions
('auto' settled once, with a ConfigError naming the field when the hardware cannot do what
was asked); ``build`` makes the model (DDP, or FSDP2 from the meta device), the optimizer
and the process groups the loop needs. No orchestrator here.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stoker.arithmetic.plan import peak_flops_of  # the one table of devices' bf16 peaks
from stoker.config import RunConfig
from stoker.failures import ConfigError
from stoker.families import build_model as build_family_model
from stoker.families import spec_of
from stoker.families.layers import checkpoint_blocks, logits_and_loss
from stoker.families.spec import param_groups


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one device, or None when it is not in the table (CPU included)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class Engine:
    device: torch.device
    bf16: bool
    compile: bool
    fused: bool
    fsdp: bool
    activation_checkpointing: str  # "none", "selective" or "full"
    prefetch: bool
    loss_chunk: int = 0  # tokens per chunk of a chunked cross-entropy; 0: the full logits
    compile_tuning: str = "none"  # or "coordinate-descent", "max-autotune"
    deterministic: bool = False  # train.deterministic, 'auto' settled for the device
    tp: int = 1  # tensor-parallel ranks per replica (engine.parallelism 'fsdp+tp'); 1: none
    ep: int = 1  # expert-parallel ranks a group (engine.ep_degree, a mixture's experts split); 1: none

    @classmethod
    def resolve(cls, cfg: RunConfig, device: torch.device, training: bool = True) -> "Engine":
        """training=False (an evaluation): the optimizer and compile settings do not apply, so
        a run's settings for GPUs do not stop its checkpoints being evaluated on a CPU."""
        e, cuda = cfg.engine, device.type == "cuda"
        if e.precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                [
                    f"engine.precision: bf16 is not supported by "
                    f"{torch.cuda.get_device_name(device)}; use 'fp32' or 'auto'."
                ]
            )
        problems = e.torch_problems(torch.__version__) + (e.cpu_problems() if not cuda else []) if training else []
        if problems:
            raise ConfigError(problems)
        bf16 = e.precision == "bf16" or (e.precision == "auto" and cuda and torch.cuda.is_bf16_supported())
        compiled = e.compile == "on" or (e.compile == "auto" and cuda)
        if training and compiled and e.parallelism == "fsdp+tp" and e.activation_checkpointing == "full":
            # torch 2.13: AOT autograd refuses a checkpointed compiled block whose recompute needs
            # the tensor-parallel DeviceMesh ("expected all tensors_saved_with_vc_check to be
            # Tensors"); 'selective' compiles and trains as eager does
            raise ConfigError(
                [
                    "engine.activation_checkpointing: 'full' under engine.parallelism 'fsdp+tp' with "
                    "torch.compile (engine.compile 'on', or 'auto' on CUDA) fails in this torch's "
                    "AOT autograd; use 'selective', or set engine.compile to 'off'."
                ]
            )
        return cls(
            device=device,
            bf16=bf16,
            compile=compiled,
            fused=e.fused_optimizer == "on" or (e.fused_optimizer == "auto" and cuda),
            fsdp=e.parallelism in ("fsdp", "fsdp+tp"),
            activation_checkpointing=e.activation_checkpointing,
            prefetch=e.prefetch,
            loss_chunk=e.cross_entropy_chunk if e.cross_entropy == "chunked" else 0,
            compile_tuning=e.compile_tuning,
            deterministic=deterministic_enabled(cfg, device),
            tp=e.tp_degree if e.parallelism == "fsdp+tp" else 1,
            ep=e.ep_degree if e.parallelism == "fsdp" else 1,
        )

    def describe(self) -> dict:
        tp = {"tp_degree": self.tp} if self.tp > 1 else {}
        if self.ep > 1:
            tp["ep_degree"] = self.ep
        return {
            "device": str(self.device),
            "precision": "bf16" if self.bf16 else "fp32",
            "compile": self.compile,
            "compile_tuning": self.compile_tuning,
            "fused_optimizer": self.fused,
            "parallelism": ("fsdp+tp" if self.tp > 1 else "fsdp") if self.fsdp else "ddp",
            **tp,
            "activation_checkpointing": self.activation_checkpointing,
            "deterministic": self.deterministic,
            "cross_entropy": (f"chunked, {self.loss_chunk} tokens a chunk" if self.loss_chunk else "standard"),
        }

    def autocast(self):
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def deterministic_enabled(cfg: RunConfig, device: torch.device) -> bool:
    """train.deterministic settled: 'auto' is on with CPU ranks (bitwise-equal resume, at
    almost no cost there) and off on CUDA (deterministic kernels and DDP's fixed buckets cost
    speed; a resumed GPU run is then equal up to rounding, not bit for bit)."""
    value = cfg.train.deterministic
    return device.type != "cuda" if value == "auto" else bool(value)


def configure_backends(cfg: RunConfig, device: torch.device) -> None:
    """Process-wide switches, before any CUDA work: TF32 and deterministic algorithms."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.engine.tf32
        torch.backends.cudnn.allow_tf32 = cfg.engine.tf32
    if deterministic_enabled(cfg, device):
        # cuBLAS is deterministic only with a fixed workspace; set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def compile_options(tuning: str) -> dict:
    """torch.compile's arguments for engine.compile_tuning. Coordinate-descent tuning is an
    inductor setting of the process (one model per process here), set before the first
    compile."""
    import torch._inductor.config as inductor

    inductor.coordinate_descent_tuning = tuning == "coordinate-descent"
    return {"mode": "max-autotune-no-cudagraphs"} if tuning == "max-autotune" else {}


def _build_fsdp(cfg: RunConfig, vocab_size: int, engine: Engine, world_size: int, init: bool) -> torch.nn.Module:
    """FSDP2 in torchtitan's order: tensor parallel (engine.tp > 1: the model split over each
    group of tp ranks, training.parallel), activation checkpointing (each block's forward
    wrapped), then compile (each block the family's spec names, and the output layer with the
    loss), then fully_shard (each block, then the root; over the "dp" dimension of the 2D mesh
    under tensor parallel); built on the meta device and materialized after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    spec = spec_of(cfg.model)
    with torch.device("meta"):
        raw = spec.build(cfg.model, vocab_size, None)
    raw.loss_chunk = engine.loss_chunk
    experts_mesh = None
    if engine.tp > 1:
        from stoker.training.parallel import apply_tp, device_mesh_2d

        mesh_2d = device_mesh_2d(engine.device.type, world_size, engine.tp)
        apply_tp(raw, mesh_2d["tp"])
        mesh = mesh_2d["dp"]
    else:
        mesh = init_device_mesh(engine.device.type, (world_size,))
    if engine.ep > 1:  # the experts over (world / ep, ep): split on "ep", FSDP2 over "dp"
        from stoker.training.parallel import apply_ep

        experts_mesh = init_device_mesh(
            engine.device.type, (world_size // engine.ep, engine.ep), mesh_dim_names=("dp", "ep")
        )
        apply_ep(raw, experts_mesh["ep"])
    checkpoint_blocks(spec.blocks(raw), engine.activation_checkpointing)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if engine.bf16
        else MixedPrecisionPolicy()
    )
    options = compile_options(engine.compile_tuning) if engine.compile else {}
    for block in spec.blocks(raw):
        if engine.compile:  # per block, as torchtitan does under FSDP2
            block.compile(**options)
        if experts_mesh is not None and getattr(block, "sparse", False):
            # the experts sharded over the ranks that hold the same experts (their gradients
            # scaled by 1 / ep_degree on the way in: families.moe, since gloo has no PREMUL_SUM
            # for FSDP2's gradient_divide_factor)
            fully_shard(block.mlp.experts, mesh=experts_mesh["dp"], mp_policy=mp)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # else the vocabulary-wide matmul and cross-entropy run eagerly (under tensor parallel
    # always: its vocabulary-parallel loss all-reduces inside an autograd function)
    if engine.compile and engine.tp == 1:
        raw.output_loss = torch.compile(logits_and_loss, **options)
    fully_shard(raw, mesh=mesh, mp_policy=mp)
    raw.to_empty(device=engine.device)
    if init:  # else every weight is loaded next (a base): no full tensor is ever made here
        spec.init_weights(raw, cfg.train.seed)
    return raw


def build_model(cfg: RunConfig, vocab_size: int, engine: Engine, world_size: int, init: bool = True):
    """(raw_model, model): the module whose parameters the optimizer and checkpoints see,
    and the one the step calls (compiled and/or DDP-wrapped). Initial weights are the same
    under DDP and FSDP2 (a function of the seed and the parameter names); init=False leaves
    them to the caller, who loads every one (a base model's)."""
    if engine.fsdp:
        raw = _build_fsdp(cfg, vocab_size, engine, world_size, init)
        return raw, raw
    device = engine.device
    raw = build_family_model(cfg.model, vocab_size, seed=cfg.train.seed if init else None).to(device)
    raw.loss_chunk = engine.loss_chunk
    checkpoint_blocks(spec_of(cfg.model).blocks(raw), engine.activation_checkpointing)
    model = torch.compile(raw, **compile_options(engine.compile_tuning)) if engine.compile else raw
    # alone (torchrun --nproc-per-node=1 included) there is nothing to all-reduce: no DDP,
    # whose wrapper would split the compiled graph at its bucket boundaries for nothing
    if world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        # DDP rebuilds its gradient buckets after its first step, in the order gradients became
        # ready; a resumed process rebuilds after its own first step, so for one step its
        # buckets (and so the order a ring all-reduce adds more than two ranks' gradients)
        # differ from the unbroken run's. find_unused_parameters turns the rebuild off: with
        # train.deterministic and more than 2 ranks, a resumed run stays bitwise equal (at the
        # cost of one graph traversal per step).
        fixed_buckets = engine.deterministic and world_size > 2
        model = DDP(model, device_ids=ids, gradient_as_bucket_view=True, find_unused_parameters=fixed_buckets)
    return raw, model


def build_optimizer(cfg: RunConfig, raw_model: torch.nn.Module, engine: Engine) -> torch.optim.AdamW:
    t = cfg.train
    impl = {"fused": True} if engine.fused else {"foreach": cfg.engine.fused_optimizer != "off"}
    return torch.optim.AdamW(param_groups(raw_model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), **impl)


@contextmanager
def grad_sync(model: torch.nn.Module, enabled: bool):
    """Gradient all-reduce (DDP) or reduce-scatter (FSDP2) only when enabled: on the last
    micro-batch of an accumulated step."""
    if enabled:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def side_group() -> "dist.ProcessGroup | None":
    """A gloo group over every rank, for traffic that must not share the world group's
    queue (the stop vote, the checkpoint writer's thread). Collective: every rank calls it
    in the same order. None when alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")
