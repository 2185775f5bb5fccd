"""The llama family's config section (torch-free): its fields, its checks against a base's
config.json, its parameter count and plan shape and the sizes its tensor-parallel plan divides."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.families.section import UnsupportedArchitecture, _field, _ModelSection, _opt, _rule  # noqa: F401


class LlamaConfig(_ModelSection):
    """Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "n_layer": 4,
        "n_head": 4,
        "n_kv_head": 2,
        "n_embd": 128,
        "intermediate_size": 352,
        "rope_theta": 500000.0,
        "rope_type": "default",
        "norm_eps": 1e-5,
        "qkv_bias": False,
        "tie_embeddings": True,
    }
    FROM_BASE: ClassVar[tuple[str, ...]] = (
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "intermediate_size",
        "head_dim",
        "vocab_size",
        "rope_theta",
        "rope_type",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_context",
        "norm_eps",
        "qkv_bias",
        "tie_embeddings",
        "max_position_embeddings",
    )
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2")
    TENSOR_PARALLEL: ClassVar[bool] = True

    family: Literal["llama"] = Field(
        "llama", description="The model family (stoker.families: one folder each); the fields below are this family's."
    )
    n_layer: int | None = _opt("Number of transformer blocks (default 4).", fix="e.g. 16", ge=1)
    n_head: int | None = _opt("Query heads per block (default 4).", fix="e.g. 32", ge=1)
    n_kv_head: int | None = _opt(
        "Key/value heads (grouped-query attention); must divide n_head (default 2).", fix="e.g. 8", ge=1
    )
    n_embd: int | None = _opt("Hidden width (default 128).", fix="e.g. 2048", ge=1)
    intermediate_size: int | None = _opt("Width of the SwiGLU MLP (default 352).", fix="e.g. 8192", ge=1)
    head_dim: int | None = _opt(
        "Width of one attention head; empty: n_embd / n_head.", fix="e.g. 64, or leave it empty", ge=1
    )
    vocab_size: int | None = _opt(
        "Embedding rows; empty: the tokenizer's size padded to vocab_pad_multiple. A base sets "
        "its own (it may hold rows its tokenizer never uses).",
        fix="at least the tokenizer's size, or leave it empty",
        ge=1,
    )
    rope_theta: float | None = _opt("RoPE base frequency (default 500000).", fix="e.g. 10000 or 500000", gt=0)
    rope_type: Literal["default", "llama3"] | None = Field(
        None, description="RoPE scaling: 'default' (none) or 'llama3' (Llama 3.1/3.2's frequency scaling)."
    )
    rope_factor: float | None = _opt("llama3 RoPE: the scaling factor (e.g. 8 or 32).", fix="e.g. 8.0", gt=0)
    rope_low_freq_factor: float | None = _opt("llama3 RoPE: low_freq_factor (e.g. 1).", fix="e.g. 1.0", gt=0)
    rope_high_freq_factor: float | None = _opt("llama3 RoPE: high_freq_factor (e.g. 4).", fix="e.g. 4.0", gt=0)
    rope_original_context: int | None = _opt(
        "llama3 RoPE: original_max_position_embeddings (e.g. 8192).", fix="e.g. 8192", ge=1
    )
    norm_eps: float | None = _opt("RMSNorm epsilon (default 1e-5).", fix="e.g. 1e-5 or 1e-6", gt=0)
    qkv_bias: bool | None = Field(None, description="Bias on the q, k and v projections (Qwen2); default false.")
    tie_embeddings: bool | None = Field(
        None, description="Share the embedding and output matrices (Llama 3.2 1B/3B); default true."
    )
    max_position_embeddings: int | None = _opt(
        "The longest context the model was trained for (a base's); block_size may not exceed it.",
        fix="at least block_size, or leave it empty",
        ge=1,
    )

    @field_validator("n_kv_head")
    @classmethod
    def _kv_heads_divide_heads(cls, n_kv_head: int | None, info: ValidationInfo) -> int | None:
        n_head = info.data.get("n_head")
        if n_head and n_kv_head and n_head % n_kv_head:
            raise _rule(f"does not divide n_head={n_head}", "pick a divisor of n_head, e.g. 1 or n_head")
        return n_kv_head

    @field_validator("head_dim")
    @classmethod
    def _width_splits_into_heads(cls, head_dim: int | None, info: ValidationInfo) -> int | None:
        n_head, n_embd = info.data.get("n_head"), info.data.get("n_embd")
        if head_dim is None and n_head and n_embd and n_embd % n_head:
            raise _rule(f"is empty and n_embd={n_embd} is not divisible by n_head={n_head}", "set head_dim")
        if (head_dim or (n_embd or 0) // max(1, n_head or 1)) % 2:
            raise _rule("must be even (RoPE rotates pairs)", "use an even head width")
        return head_dim

    @field_validator("rope_original_context")
    @classmethod
    def _llama3_rope_complete(cls, value: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("rope_type") == "llama3":
            fields = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor")
            missing = [f for f in fields if info.data.get(f) is None] + ([] if value else ["rope_original_context"])
            if missing:
                raise _rule(f"rope_type 'llama3' needs {', '.join(missing)}", "set them, or use rope_type 'default'")
        return value

    @field_validator("max_position_embeddings")
    @classmethod
    def _context_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        block = info.data.get("block_size")
        if value is not None and block and block > value:
            raise _rule(
                f"is below block_size={block} (the model was trained for {value} positions)",
                f"set model.block_size to at most {value}",
            )
        return value

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        """What the plan reads of this model (arithmetic.plan.Shape), counted from the family's module (model.py):
        each RMSNorm keeps its input and its normalized value (fp32); the q, k, v (and gate,
        up) inputs, one tensor under fp32 and a cast copy each under bf16; q and k roped, v,
        the attention's output and o_proj's copy of it; gate's output (kept by SiLU), SiLU's
        output and up's (kept by the product) and the product (kept by down). Selective
        checkpointing keeps the outputs of the seven projections and of the attention."""
        C, T = self.n_embd, self.block_size
        hd = self.head_dim or C // self.n_head
        q, kv, inner = self.n_head * hd, self.n_kv_head * hd, self.intermediate_size
        block = 2 * C + C * (q + 2 * kv) + ((q + 2 * kv) if self.qkv_bias else 0) + q * C + 3 * C * inner
        embedding, output = vocab_rows * C, 0 if self.tie_embeddings else vocab_rows * C
        return dict(
            layers=self.n_layer,
            width=C,
            vocab=vocab_rows,
            block=T,
            block_params=block,
            root_params=embedding + output + C,
            # the input embedding is a lookup, not a matmul, unless it is the output's too
            matmul_params=self.n_layer * block + C + (embedding if output == 0 else output),
            attention_width=q,
            saved_fp32=4 * C,
            matmul_inputs_fp32=2 * C,
            matmul_inputs_bf16=5 * C,
            saved_matmul=(q + 2 * kv) + 2 * q + 4 * inner,
            kept_selective=(q + 2 * kv) + 2 * C + 2 * inner + q,
            final_norm_fp32=2 * C,
        )

    def unresolved(self) -> list[str]:
        """Architecture fields still empty; llama3 RoPE's factors only under rope_type 'llama3'."""
        scaling = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
        empty = super().unresolved()
        return [n for n in empty if n not in scaling] if self.rope_type == "default" else empty

    def tp_split_sizes(self) -> list[tuple[str, int | None]]:
        """Each rank of a tensor-parallel group holds n_head / tp query heads, n_kv_head / tp
        key/value heads, intermediate_size / tp of the MLP and block_size / tp positions of the
        residual stream (``parallel.py``)."""
        return [(n, getattr(self, n)) for n in ("n_head", "n_kv_head", "intermediate_size", "block_size")]

    def describe(self) -> str:
        return (
            f"llama, {self.n_layer} layers x {self.n_embd}, {self.n_head}/{self.n_kv_head} q/kv heads, "
            f"block {self.block_size}"
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        kind = hf.get("model_type")
        if kind not in cls.HF_MODEL_TYPES:
            raise UnsupportedArchitecture(f"model_type {kind!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"hidden_act {hf['hidden_act']!r} (the llama family has silu)")
        if hf.get("mlp_bias"):
            raise UnsupportedArchitecture("mlp_bias: true")
        for moe in ("num_local_experts", "num_experts", "moe_intermediate_size"):
            if hf.get(moe):
                raise UnsupportedArchitecture(f"a mixture of experts ({moe}: {hf[moe]})")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedArchitecture(f"pretraining_tp: {hf['pretraining_tp']}")
        n_head = hf["num_attention_heads"]
        fields: dict[str, Any] = {
            "n_layer": hf["num_hidden_layers"],
            "n_head": n_head,
            "n_kv_head": hf.get("num_key_value_heads") or n_head,
            "n_embd": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // n_head,
            "vocab_size": hf["vocab_size"],
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            # transformers' default (LlamaConfig, Qwen2Config, MistralConfig): untied
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "max_position_embeddings": hf.get("max_position_embeddings"),
            "rope_type": "default",
            "rope_factor": None,
            "rope_low_freq_factor": None,
            "rope_high_freq_factor": None,
            "rope_original_context": None,
        }
        if kind == "qwen2":
            fields["qkv_bias"] = True
        else:
            if hf.get("attention_bias"):
                raise UnsupportedArchitecture("attention_bias: true on the output projection")
            fields["qkv_bias"] = False
        # transformers v5 keeps RoPE in rope_parameters (theta inside); v4 in rope_theta/rope_scaling
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        fields["rope_theta"] = float(theta)
        kind_of_rope = rope.get("rope_type", rope.get("type", "default")) or "default"
        if kind_of_rope == "llama3":
            fields.update(
                rope_type="llama3",
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_context=int(rope["original_max_position_embeddings"]),
            )
        elif kind_of_rope != "default":
            raise UnsupportedArchitecture(f"rope_type {kind_of_rope!r} (the llama family has default and llama3)")
        return fields

    @classmethod
    def hf_limits(cls, hf: dict) -> dict[str, Any]:
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", hf.get("model_type") == "mistral")
        return {
            "max_positions": hf.get("max_position_embeddings"),
            "vocab_rows": hf["vocab_size"],
            "sliding_window": int(window) if window and uses_window else None,
        }

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.qkv_bias else "llama",
            "hidden_act": "silu",
            "hidden_size": self.n_embd,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_head,
            "head_dim": self.resolved_head_dim,
            "vocab_size": vocab_rows,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": bool(self.tie_embeddings),
            "max_position_embeddings": self.max_position_embeddings or self.block_size,
            "rope_theta": self.rope_theta,
            "attention_dropout": self.dropout,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.qkv_bias:
            out["use_sliding_window"] = False
        else:
            out.update(attention_bias=False, mlp_bias=False)
        if self.rope_type == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_context,
            }
        return out
