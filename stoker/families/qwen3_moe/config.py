"""The qwen3_moe family's config section (torch-free): the qwen3 family's fields, plus the
experts (``num_experts`` of ``moe_intermediate_size``, ``num_experts_per_tok`` a token,
``norm_topk_prob``), which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``: the
others are dense SwiGLU MLPs of ``intermediate_size``) and the router's loss coefficient; its
config.json is Qwen3-MoE's (which spells num_experts num_local_experts when transformers 5
writes it)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.families.llama.config import LlamaConfig
from stoker.families.moe_section import MoeFields, refuse_foreign_moe
from stoker.families.qwen3.config import Qwen3Config
from stoker.families.section import UnsupportedArchitecture, _opt, _rule

_MOE_KEYS = ("num_local_experts", "num_experts", "moe_intermediate_size", "num_experts_per_tok")


class Qwen3MoeConfig(MoeFields, Qwen3Config):
    """Qwen3-MoE: Qwen3's blocks with sparse mixtures of SwiGLU experts as their MLPs."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        **Qwen3Config.DEFAULTS,
        "intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_embeddings": False,
    }
    FROM_BASE: ClassVar[tuple[str, ...]] = (
        Qwen3Config.FROM_BASE + MoeFields.MOE_FROM_BASE + ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
    )
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_moe",)
    TENSOR_PARALLEL: ClassVar[bool] = False  # the experts have no tensor-parallel plan: expert parallel instead

    family: Literal["qwen3_moe"] = Field(
        "qwen3_moe",
        description="The model family (stoker.families: one folder each); the fields below are this family's.",
    )
    norm_topk_prob: bool | None = Field(
        None, description="Renormalize each token's top-k routing weights to sum to 1 (Qwen3-30B-A3B: true)."
    )
    decoder_sparse_step: int | None = _opt(
        "Every this-many-th layer is sparse (1: all), counting from 1.", fix="e.g. 1", ge=1
    )
    mlp_only_layers: list[int] | None = Field(
        None, description="Layers (0-based) that keep a dense MLP of intermediate_size; empty: none."
    )

    @field_validator("mlp_only_layers")
    @classmethod
    def _layers_exist(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        n = info.data.get("n_layer")
        bad = [i for i in value or [] if n and not 0 <= i < n]
        if bad:
            raise _rule(f"names layers {bad} of a {n}-layer model", f"give layer numbers 0 to {n - 1}")
        return value

    def sparse_layers(self) -> list[int]:
        """transformers' rule: layer i is sparse unless in mlp_only_layers, when (i + 1) is a
        multiple of decoder_sparse_step."""
        dense = set(self.mlp_only_layers or [])
        step = self.decoder_sparse_step or 1
        return [i for i in range(self.n_layer) if i not in dense and (i + 1) % step == 0]

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        return self.moe_plan_shape(super().plan_shape(vocab_rows))

    def describe(self) -> str:
        return (
            f"qwen3_moe, {self.n_layer} layers x {self.n_embd}, {self.n_head}/{self.n_kv_head} q/kv heads of "
            f"{self.resolved_head_dim}, {self.describe_experts()}, block {self.block_size}"
        )

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        if hf.get("model_type") != "qwen3_moe":
            raise UnsupportedArchitecture(f"model_type {hf.get('model_type')!r}")
        if hf.get("attention_bias"):
            raise UnsupportedArchitecture("attention_bias: true (the qwen3_moe family has no q/k/v/o bias)")
        refuse_foreign_moe(hf)
        fields = LlamaConfig.from_hf_config.__func__(cls, {k: v for k, v in hf.items() if k not in _MOE_KEYS})
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if not experts:
            raise UnsupportedArchitecture("num_experts: 0 (a dense model: use the qwen3 family)")
        fields.update(
            num_experts=int(experts),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=[int(i) for i in hf.get("mlp_only_layers") or []],
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        return fields

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        out = super().to_hf_config(vocab_rows)
        out.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=bool(self.norm_topk_prob),
            decoder_sparse_step=self.decoder_sparse_step or 1,
            mlp_only_layers=list(self.mlp_only_layers or []),
            router_aux_loss_coef=self.aux_loss_coef,
            output_router_logits=False,
        )
        return out
