"""The engine section (``EngineConfig``): how the ranks compute (precision, compile, fused
optimizer, parallelism, activation checkpointing, the loss), none of it the run's identity."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.fields import _field, _rule, _Section

# (distribute_tensor's src_data_rank=None: every rank fills its own shard, no communication)
# is 2.7's
FSDP2_TORCH = (2, 7)


class EngineConfig(_Section):
    """How the ranks compute: none of it changes what the run is (a run may resume with other
    engine settings), so it is left out of the run's identity."""

    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="Matmul precision: 'bf16' autocast (fp32 weights and optimizer), "
        "'fp32', or 'auto': bf16 on a CUDA device that supports it, fp32 otherwise.",
    )
    tf32: bool = Field(True, description="On CUDA, let fp32 matmuls and convolutions use TF32.")
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the model: 'auto' is on for CUDA, off on CPU (a compiled first step takes 20-60 s).",
    )
    compile_tuning: Literal["none", "coordinate-descent", "max-autotune"] = Field(
        "none",
        description="How hard torch.compile tunes, with compile on: 'coordinate-descent' "
        "tunes the launch parameters of each fused kernel (on an H100, bench_gpu's bare loop "
        "with cuDNN attention went from 42.0% to 42.7% MFU, its first compile from ~25 s to "
        "~150 s); 'max-autotune' also times Triton matmul kernels against cuBLAS (a first "
        "compile of minutes).",
    )
    fused_optimizer: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Fused AdamW kernels: 'auto' is fused on CUDA, multi-tensor "
        "(foreach) on CPU; 'off' is the plain per-parameter loop.",
    )
    parallelism: Literal["ddp", "fsdp", "fsdp+tp"] = Field(
        "ddp",
        description="'ddp': replicated model, gradients all-reduced. 'fsdp': FSDP2 "
        "(fully_shard per block and on the root; bf16 params, fp32 gradient reduction under "
        "bf16) for models whose state does not fit on one device; needs torch 2.7 or newer. "
        "'fsdp+tp' (llama family): FSDP2 over the data-parallel dimension of a 2D mesh and "
        "tensor parallel within each group of engine.tp_degree ranks of a node (torchtitan's "
        "plan: column- and row-wise projections, sequence-parallel norms, a "
        "vocabulary-parallel loss); the global batch is split over world_size / tp_degree "
        "replicas. Checkpoints load under any other parallelism and mesh.",
    )
    tp_degree: int = _field(
        1,
        "Ranks of one tensor-parallel group under engine.parallelism 'fsdp+tp' (2 or more; a "
        "divisor of launch.nproc_per_node, and of the model's n_head, n_kv_head, "
        "intermediate_size and block_size); 1 with 'ddp' and 'fsdp'.",
        fix="e.g. 2, 4 or 8 with 'fsdp+tp', else 1",
        ge=1,
        validate_default=True,  # 'fsdp+tp' with the default 1 is refused
    )
    ep_degree: int = _field(
        1,
        "Expert parallel (a mixture of experts: the qwen3_moe and mixtral families): each "
        "sparse layer's experts are split over groups of ep_degree ranks, tokens sent to their "
        "expert's rank and back by all-to-all, under engine.parallelism 'fsdp' (the experts "
        "sharded by FSDP2 over world_size / ep_degree ranks, the rest over all). A divisor of "
        "the world size and of model.num_experts; 1: every rank runs every expert. "
        "Checkpoints load under any other ep_degree and world size.",
        fix="e.g. 2, 4 or 8 (a divisor of the world size and of model.num_experts), or 1",
        ge=1,
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none",
        description="'full': recompute each block in the backward pass (about a third "
        "more compute for the least activation memory). 'selective': keep the outputs of the "
        "matmuls and attention and recompute only the cheap ops between them (LayerNorm, GELU, "
        "dropout, residual adds): less memory than 'none' for little extra compute.",
    )
    cross_entropy: Literal["standard", "chunked"] = Field(
        "standard",
        description="'standard': the output matmul makes the whole (tokens x "
        "vocabulary) logits, then the loss. 'chunked': the matmul and the loss run "
        "engine.cross_entropy_chunk tokens at a time, with the gradient made in the forward "
        "pass, so the whole logits, their fp32 copy and their gradient never exist (GBs at "
        "GPT-2's vocabulary): a larger micro-batch fits. The same loss up to rounding.",
    )
    cross_entropy_chunk: int = _field(
        4096, "Tokens per chunk of the 'chunked' cross-entropy: fewer hold less memory and make smaller matmuls.", ge=1
    )
    prefetch: bool = Field(
        True,
        description="Prepare the next batch in a background thread while the step runs "
        "(pinned memory, non-blocking copies on CUDA).",
    )

    @field_validator("tp_degree")
    @classmethod
    def _tp_degree_fits_the_parallelism(cls, tp_degree: int, info: ValidationInfo) -> int:
        parallelism = info.data.get("parallelism")
        if parallelism == "fsdp+tp" and tp_degree == 1:
            raise _rule(
                "is 1, and engine.parallelism 'fsdp+tp' splits the model over groups of tp_degree ranks",
                "set 2 or more (a divisor of launch.nproc_per_node), or use engine.parallelism 'fsdp'",
            )
        if parallelism in ("ddp", "fsdp") and tp_degree > 1:
            raise _rule(
                f"splits the model over ranks, which engine.parallelism '{parallelism}' does not do",
                "set engine.parallelism to 'fsdp+tp', or tp_degree to 1",
            )
        return tp_degree

    @field_validator("cross_entropy")
    @classmethod
    def _whole_loss_under_tensor_parallel(cls, cross_entropy: str, info: ValidationInfo) -> str:
        if cross_entropy == "chunked" and info.data.get("parallelism") == "fsdp+tp":
            raise _rule(
                "'chunked' is not done under engine.parallelism 'fsdp+tp', whose loss is "
                "vocabulary-parallel (a rank holds 1/tp_degree of the logits)",
                "use 'standard'",
            )
        return cross_entropy

    @field_validator("compile", "fused_optimizer", mode="before")
    @classmethod
    def _on_off_words(cls, value: Any) -> Any:
        """YAML reads on and off (in a recipe, or a --set value) as true and false: they mean
        the words."""
        return ("on" if value else "off") if isinstance(value, bool) else value

    def cpu_problems(self) -> list[str]:
        """What ranks on CPUs cannot do of these settings: checked on the host before the
        launch (launch.devices, for the ranks it starts there) and by each rank."""
        problems = []
        if self.fused_optimizer == "on":
            problems.append(
                "engine.fused_optimizer: fused AdamW needs a CUDA device and the "
                "ranks run on CPUs; use 'auto' or 'off'."
            )
        if self.compile_tuning != "none" and self.compile == "auto":
            problems.append(
                f"engine.compile_tuning: '{self.compile_tuning}' tunes torch.compile, "
                "which engine.compile 'auto' leaves off on CPUs; use 'none', or set "
                "engine.compile to 'on'."
            )
        return problems

    def torch_problems(self, torch_version: str) -> list[str]:
        """What ranks with this torch (its version string, e.g. '2.5.1+cu124') cannot do of
        these settings: checked on the host before the launch, from the installed package's
        metadata, and by each rank."""
        found = re.match(r"(\d+)\.(\d+)", torch_version)
        release = (int(found[1]), int(found[2])) if found else (0, 0)
        if self.parallelism in ("fsdp", "fsdp+tp") and release < FSDP2_TORCH:
            return [
                f"engine.parallelism: '{self.parallelism}' needs torch {FSDP2_TORCH[0]}.{FSDP2_TORCH[1]} or newer "
                f"(FSDP2's fully_shard and its sharded init) and the ranks have torch {torch_version}; upgrade torch, or "
                "use 'ddp'."
            ]
        return []

    @field_validator("compile_tuning")
    @classmethod
    def _tunes_a_compile(cls, tuning: str, info: ValidationInfo) -> str:
        if tuning != "none" and info.data.get("compile") == "off":
            raise _rule(
                "tunes torch.compile, which engine.compile turns off",
                "use 'none', or set engine.compile to 'on' or 'auto'",
            )
        return tuning
