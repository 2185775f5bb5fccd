"""What every mixture-of-experts family's config section shares (torch-free): the experts'
fields, which layers are sparse, the router's loss coefficient, and the count of total and
active parameters the plan and the trainer's FLOPs read. A family (qwen3_moe, mixtral) mixes
this into its dense parent's section (``class Qwen3MoeConfig(MoeFields, Qwen3Config)``) and
says how its config.json spells them (``moe_from_hf``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.families.section import UnsupportedArchitecture, _ModelSection, _opt, _rule

# config.json fields of mixtures that no family here expresses: refused by name
FOREIGN_MOE_FIELDS = {
    "shared_expert_intermediate_size": "a shared expert",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "scoring_func": "a router scoring function other than softmax",
    "topk_method": "a grouped top-k router",
    "n_group": "a grouped router",
    "topk_group": "a grouped router",
    "routed_scaling_factor": "a routed scaling factor",
    "first_k_dense_replace": "dense first layers by count",
    "moe_layer_freq": "sparse layers by frequency",
    "router_bias": "a router bias",
    "moe_shared_expert_intermediate_size": "a shared expert",
    "num_experts_per_tok_dense": "dense experts",
}


class MoeFields(_ModelSection):
    """The experts of a mixture: E per sparse layer, k per token, the expert width."""

    MOE: ClassVar[bool] = True
    # the fields a base's config.json fixes, beyond the dense parent's
    MOE_FROM_BASE: ClassVar[tuple[str, ...]] = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")

    num_experts: int | None = _opt("Experts per sparse layer (E).", fix="e.g. 8 or 128", ge=1)
    num_experts_per_tok: int | None = _opt(
        "Experts each token is routed to (top-k); at most num_experts.", fix="e.g. 2 or 8", ge=1
    )
    moe_intermediate_size: int | None = _opt("Width of one expert's SwiGLU MLP.", fix="e.g. 768", ge=1)
    router_aux_loss_coef: float | None = Field(
        None,
        description="Weight of the router's load-balancing loss (Switch) in the training loss; 0 turns it off. "
        "Empty: the base's router_aux_loss_coef (0.001 without a base). Never part of a validation loss, bits "
        "per byte or score.",
        json_schema_extra={"fix": "give a number >= 0 (e.g. 0.001), or leave it empty for the base's"},
        ge=0,
    )
    experts_impl: Literal["grouped", "loop"] = Field(
        "grouped",
        description="How the experts run: 'grouped' (tokens sorted by expert, one grouped matmul per projection: "
        "torch._grouped_mm) or 'loop' (one matmul per expert: the exact reference, slower).",
        json_schema_extra={"fix": "give 'grouped' or 'loop'"},
    )

    @field_validator("num_experts_per_tok")
    @classmethod
    def _k_at_most_e(cls, value: int | None, info: ValidationInfo) -> int | None:
        experts = info.data.get("num_experts")
        if value and experts and value > experts:
            raise _rule(f"is above num_experts={experts}", f"route each token to at most {experts} experts")
        return value

    # ---- which layers are sparse (a family with dense layers among them overrides this) ----
    def sparse_layers(self) -> list[int]:
        return list(range(self.n_layer))

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size

    @property
    def aux_loss_coef(self) -> float:
        return 0.001 if self.router_aux_loss_coef is None else float(self.router_aux_loss_coef)

    # ---- the plan's count -------------------------------------------------------------------
    def moe_counts(self) -> dict[str, int]:
        """Per model: the experts' parameters (all, and those a token runs), the routers'."""
        C, F, E, k = self.n_embd, self.expert_width, self.num_experts, self.num_experts_per_tok
        sparse = len(self.sparse_layers())
        return {
            "sparse_layers": sparse,
            "expert_params": sparse * E * 3 * C * F,
            "active_expert_params": sparse * k * 3 * C * F,
            "router_params": sparse * E * C,
        }

    def moe_plan_shape(self, shape: dict[str, int]) -> dict[str, int]:
        """The dense parent's shape (every layer dense, of intermediate_size) made this mixture's:
        each sparse layer's MLP replaced by its router and experts in the parameters; in the
        FLOPs (matmul_params) by the router and the k experts a token runs; in what a layer keeps
        per token by k experts' worth of SwiGLU activations, the routed copy of each input and
        the router's probabilities (averaged over the layers, dense and sparse alike)."""
        C, L = self.n_embd, self.n_layer
        dense_mlp = 3 * C * self.intermediate_size
        m = self.moe_counts()
        sparse, k, F, E = m["sparse_layers"], self.num_experts_per_tok, self.expert_width, self.num_experts
        blocks = L * shape["block_params"] - sparse * dense_mlp + m["expert_params"] + m["router_params"]
        out = dict(shape)
        out["block_params"] = -(-blocks // L)  # the mean block, rounded up
        out["matmul_params"] = (
            shape["matmul_params"] - sparse * dense_mlp + m["active_expert_params"] + m["router_params"]
        )
        mlp_saved = 4 * self.intermediate_size
        moe_saved = 4 * k * F + k * C + E
        out["saved_matmul"] = shape["saved_matmul"] + (sparse * (moe_saved - mlp_saved)) // L
        out["kept_selective"] = (
            shape["kept_selective"] + (sparse * (2 * k * F + k * C - 2 * self.intermediate_size)) // L
        )
        out["active_params"] = out["matmul_params"]
        out["expert_params"] = m["expert_params"]
        out["experts"] = E
        out["top_k"] = k
        out["sparse_layers"] = sparse
        return out

    def describe_experts(self) -> str:
        dense = self.n_layer - len(self.sparse_layers())
        return f"{self.num_experts} experts top-{self.num_experts_per_tok} of {self.expert_width}" + (
            f", {dense} dense layer(s)" if dense else ""
        )


def refuse_foreign_moe(hf: dict) -> None:
    """UnsupportedArchitecture naming the first config.json field of a mixture no family here
    expresses (a shared expert, a sigmoid or grouped router, ...)."""
    for name, what in FOREIGN_MOE_FIELDS.items():
        value = hf.get(name)
        if value not in (None, 0, False, [], "softmax", "greedy", 1.0) or (name == "router_bias" and value):
            raise UnsupportedArchitecture(f"{what} ({name}: {value!r})")
    if hf.get("router_jitter_noise"):
        raise UnsupportedArchitecture(f"router jitter noise (router_jitter_noise: {hf['router_jitter_noise']})")
