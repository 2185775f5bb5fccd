"""The qwen3 family's config section (torch-free): Qwen3's dense models are the llama family's
blocks with a per-head RMSNorm on q and k (before RoPE), no q/k/v bias and an explicit
head_dim (Qwen3-0.6B: 16 heads of 128 over a width of 1024). Its fields, checks and plan shape
are the llama family's, plus the two norms; its config.json is Qwen3's."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.families.llama.config import LlamaConfig
from stoker.families.section import UnsupportedArchitecture, _rule


class Qwen3Config(LlamaConfig):
    """Qwen3 (dense): RMSNorm, RoPE, grouped-query attention with q/k RMSNorm per head, SwiGLU."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        **LlamaConfig.DEFAULTS,
        "head_dim": 48,  # not n_embd / n_head, as Qwen3's own shapes
        "rope_theta": 1000000.0,
        "norm_eps": 1e-6,
    }
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3",)

    family: Literal["qwen3"] = Field(
        "qwen3", description="The model family (stoker.families: one folder each); the fields below are this family's."
    )

    @field_validator("qkv_bias")
    @classmethod
    def _no_qkv_bias(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value:
            raise _rule("is true, and Qwen3 has no q/k/v bias", "leave it empty or false")
        return value

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        """The llama family's shape plus the q and k norms: a gain of head_dim each per block,
        and what they keep per token (their fp32 input and normalized value, of the q and k
        widths)."""
        shape = super().plan_shape(vocab_rows)
        hd = self.resolved_head_dim
        q, kv = self.n_head * hd, self.n_kv_head * hd
        norms = 2 * hd
        shape["block_params"] += norms
        shape["matmul_params"] += self.n_layer * norms
        shape["saved_fp32"] += 2 * (q + kv)
        return shape

    def describe(self) -> str:
        return (
            f"qwen3, {self.n_layer} layers x {self.n_embd}, {self.n_head}/{self.n_kv_head} q/kv heads of "
            f"{self.resolved_head_dim}, block {self.block_size}"
        )

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        if hf.get("model_type") != "qwen3":
            raise UnsupportedArchitecture(f"model_type {hf.get('model_type')!r}")
        if hf.get("attention_bias"):
            raise UnsupportedArchitecture("attention_bias: true (the qwen3 family has no q/k/v/o bias)")
        return super().from_hf_config(hf)

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        out = super().to_hf_config(vocab_rows)
        for llama_only in ("mlp_bias", "rope_scaling"):
            out.pop(llama_only, None)
        out.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return out
