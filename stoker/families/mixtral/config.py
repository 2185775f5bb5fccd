"""The mixtral family's config section (torch-free): the llama family's fields with every
layer's MLP a mixture of ``num_experts`` SwiGLU experts of ``intermediate_size`` (Mixtral's
config.json spells them num_local_experts and intermediate_size), top-k weights always
renormalized, no q/k/v bias; its config.json is Mixtral's."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from stoker.families.llama.config import LlamaConfig
from stoker.families.moe_section import MoeFields, refuse_foreign_moe
from stoker.families.section import UnsupportedArchitecture

# config.json fields read here beyond the dense llama family's
_MOE_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


class MixtralConfig(MoeFields, LlamaConfig):
    """Mixtral: Llama's blocks with a sparse mixture of SwiGLU experts as every MLP."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        **LlamaConfig.DEFAULTS,
        "intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "rope_theta": 1000000.0,
        "tie_embeddings": False,
    }
    FROM_BASE: ClassVar[tuple[str, ...]] = LlamaConfig.FROM_BASE + MoeFields.MOE_FROM_BASE
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("mixtral",)
    TENSOR_PARALLEL: ClassVar[bool] = False  # the experts have no tensor-parallel plan: expert parallel instead

    family: Literal["mixtral"] = Field(
        "mixtral",
        description="The model family (stoker.families: one folder each); the fields below are this family's.",
    )

    def describe(self) -> str:
        return (
            f"mixtral, {self.n_layer} layers x {self.n_embd}, {self.n_head}/{self.n_kv_head} q/kv heads, "
            f"{self.describe_experts()}, block {self.block_size}"
        )

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        return self.moe_plan_shape(super().plan_shape(vocab_rows))

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        if hf.get("model_type") != "mixtral":
            raise UnsupportedArchitecture(f"model_type {hf.get('model_type')!r}")
        refuse_foreign_moe(hf)
        if hf.get("attention_bias") or hf.get("qkv_bias"):
            raise UnsupportedArchitecture("attention biases (Mixtral has none)")
        fields = LlamaConfig.from_hf_config.__func__(cls, {k: v for k, v in hf.items() if k not in _MOE_KEYS})
        if fields["rope_type"] != "default":
            raise UnsupportedArchitecture(f"rope_type {fields['rope_type']!r} (the mixtral family has default RoPE)")
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if not experts:
            raise UnsupportedArchitecture("no num_local_experts (a dense model: use the llama family)")
        fields.update(
            num_experts=int(experts),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(hf["intermediate_size"]),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        return fields

    @classmethod
    def hf_limits(cls, hf: dict) -> dict[str, Any]:
        """Mixtral attends within sliding_window whenever config.json sets one."""
        out = super().hf_limits(hf)
        window = hf.get("sliding_window")
        out["sliding_window"] = int(window) if window else None
        return out

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        out = super().to_hf_config(vocab_rows)
        for llama_only in ("mlp_bias", "attention_bias", "use_sliding_window"):
            out.pop(llama_only, None)
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=self.expert_width,
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.aux_loss_coef,
            router_jitter_noise=0.0,
            output_router_logits=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        return out
