"""The gpt2 family's config section (torch-free): its fields, its checks against a base's
config.json, its parameter count and plan shape."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.families.section import UnsupportedArchitecture, _field, _ModelSection, _opt, _rule  # noqa: F401


class GPT2Config(_ModelSection):
    """nanoGPT's GPT: pre-norm blocks, learned positions, GELU MLP, tied embeddings."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"n_layer": 4, "n_head": 4, "n_embd": 128, "bias": False, "activation": "gelu"}
    FROM_BASE: ClassVar[tuple[str, ...]] = ("n_layer", "n_head", "n_embd", "bias", "activation")
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gpt2",)
    ROWS_ARE_THE_TOKENIZERS: ClassVar[bool] = True

    family: Literal["gpt2"] = Field(
        "gpt2", description="The model family (stoker.families: one folder each); the fields below are this family's."
    )
    n_layer: int | None = _opt("Number of transformer blocks (default 4).", fix="e.g. 4 or 12", ge=1)
    n_head: int | None = _opt("Attention heads per block; must divide n_embd (default 4).", fix="e.g. 4", ge=1)
    n_embd: int | None = _opt("Embedding width (default 128).", fix="pick a multiple of n_head", ge=1)
    bias: bool | None = Field(None, description="Use bias in Linear and LayerNorm layers (default false).")
    activation: Literal["gelu", "gelu_tanh"] | None = Field(
        None,
        description="The MLP's GELU: 'gelu' (exact, erf; the default) or 'gelu_tanh' (GPT-2's own "
        "tanh approximation, transformers' gelu_new).",
    )

    @field_validator("n_embd")
    @classmethod
    def _heads_divide_width(cls, n_embd: int | None, info: ValidationInfo) -> int | None:
        n_head = info.data.get("n_head")
        if n_head and n_embd and n_embd % n_head:
            raise _rule(
                f"is not divisible by n_head={n_head}",
                f"pick a multiple of {n_head}, e.g. {n_head * max(1, round(n_embd / n_head))}",
            )
        return n_embd

    def describe(self) -> str:
        return f"gpt2, {self.n_layer} layers x {self.n_embd}, {self.n_head} heads, block {self.block_size}"

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        """What the plan reads of this model (arithmetic.plan.Shape), counted from the family's module (model.py):
        each LayerNorm keeps its input (fp32); c_attn's and c_fc's inputs; the qkv output
        (kept by the attention), the attention's output and c_proj's copy of it, c_fc's
        output (kept by GELU) and GELU's output: 13 C in the matmul dtype. Selective
        checkpointing keeps the matmul and attention outputs: qkv, out, c_proj, c_fc, c_proj."""
        C, T, b = self.n_embd, self.block_size, 1 if self.bias else 0
        block = 2 * (C + b * C) + (3 * C * C + 3 * b * C) + (C * C + b * C) + (4 * C * C + 4 * b * C)
        block += 4 * C * C + b * C
        root = vocab_rows * C + T * C + C + b * C  # tied output matrix; positions; ln_f
        return dict(
            layers=self.n_layer,
            width=C,
            vocab=vocab_rows,
            block=T,
            block_params=block,
            root_params=root,
            matmul_params=self.n_layer * block + root - T * C,  # without the position table
            attention_width=C,
            saved_fp32=2 * C,
            matmul_inputs_fp32=2 * C,
            matmul_inputs_bf16=2 * C,
            saved_matmul=13 * C,
            kept_selective=10 * C,
            final_norm_fp32=C,
        )

    _HF_ACT: ClassVar[dict[str, str]] = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        act = hf.get("activation_function", "gelu_new")
        if act not in cls._HF_ACT:
            raise UnsupportedArchitecture(f"activation_function {act!r} (the gpt2 family has gelu and gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(flag):
                raise UnsupportedArchitecture(f"{flag}: true")
        if hf.get("scale_attn_weights", True) is False:
            raise UnsupportedArchitecture("scale_attn_weights: false")
        if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
            raise UnsupportedArchitecture(f"layer_norm_epsilon {hf['layer_norm_epsilon']} (the gpt2 family has 1e-5)")
        if hf.get("tie_word_embeddings", True) is False:
            raise UnsupportedArchitecture("tie_word_embeddings: false (the gpt2 family ties them)")
        if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
            raise UnsupportedArchitecture(f"n_inner {hf['n_inner']} (the gpt2 family has 4 x n_embd)")
        # the base's rows exactly: no padding of its embedding
        return {
            "n_layer": hf["n_layer"],
            "n_head": hf["n_head"],
            "n_embd": hf["n_embd"],
            "bias": True,
            "activation": cls._HF_ACT[act],
            "vocab_pad_multiple": 1,
        }

    @classmethod
    def hf_limits(cls, hf: dict) -> dict[str, Any]:
        return {"max_positions": hf.get("n_positions", hf.get("n_ctx")), "vocab_rows": hf["vocab_size"]}

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu" if self.activation == "gelu" else "gelu_new",
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_layer": self.n_layer,
            "n_positions": self.block_size,
            "n_ctx": self.block_size,
            "n_inner": None,
            "vocab_size": vocab_rows,
            "layer_norm_epsilon": 1e-5,
            "attn_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "resid_pdrop": self.dropout,
            "initializer_range": 0.02,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True,
            "use_cache": True,
        }
