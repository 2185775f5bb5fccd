"""The ``model`` section: one config per model family, a union on ``model.family``.

Each family declares its fields here (torch-free: the flow process reads a base's config.json
and fills the section before anything else runs) and its module in ``stoker/training/models/``
(the torch model, its init, its FLOPs and its Hugging Face state-dict adapter). The mapping of
a Hugging Face ``config.json`` to and from a family's fields lives with the fields
(``from_hf_config`` / ``to_hf_config``), so the flow process can read a base and the export can
write one without torch.

The architecture fields default to None, meaning "the base's value" when ``model.init_from``
names a base, and the family's own default otherwise (filled when the section is built). A
value given explicitly that contradicts the base's config.json is refused, naming both
values (``storage.bases.resolve_base``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from stoker.core.config.sections import _field, _rule, _Section


class UnsupportedArchitecture(ValueError):
    """A base whose architecture no family expresses exactly (refused, never approximated)."""


def _opt(description: str, *, fix: str | None = None, **constraints: Any) -> Any:
    """An architecture field: None until the base or the family default fills it. Validated
    even when left out (its cross-field rule reads the fields before it)."""
    return Field(
        None,
        description=description,
        json_schema_extra={"fix": fix} if fix else None,
        validate_default=True,
        **constraints,
    )


class _ModelSection(_Section):
    """What every family shares: where the weights come from, the context, the padding."""

    # the family's defaults for its architecture fields (None in the schema: from the base)
    DEFAULTS: ClassVar[dict[str, Any]] = {}
    # the fields a base's config.json fixes (a contradicting explicit value is refused)
    FROM_BASE: ClassVar[tuple[str, ...]] = ()
    # the config.json model_type values this family reads
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    # the embedding has exactly one row per tokenizer id (no vocab_size field of its own)
    ROWS_ARE_THE_TOKENIZERS: ClassVar[bool] = False
    # the family has a tensor-parallel plan (engine.parallelism 'fsdp+tp': training.parallel)
    TENSOR_PARALLEL: ClassVar[bool] = False

    init_from: str | None = Field(
        None,
        description="Start from a Hugging Face model: a folder or an object-store URL holding "
        "config.json, model.safetensors (or shards with model.safetensors.index.json), "
        "tokenizer.json and tokenizer_config.json. The architecture comes from its config.json, "
        "the tokenizer is its tokenizer, the weights are its weights until the run's first "
        "checkpoint. Empty: random weights from train.seed.",
        json_schema_extra={"fix": "give a folder or URL of a Hugging Face model, or leave it empty"},
    )
    base_sha256: str | None = Field(
        None,
        description="Set by stoker from model.init_from: the sha256 over the base's files, which "
        "pins the run (and every checkpoint) to those exact bytes. Leave it empty.",
        json_schema_extra={"fix": "leave it empty: stoker computes it from model.init_from"},
        pattern=r"^[0-9a-f]{64}$",
    )
    block_size: int = _field(
        128,
        "Training context in tokens; with a base, at most its max_position_embeddings.",
        fix="e.g. 128 or 1024",
        ge=1,
    )
    dropout: float = _field(
        0.0,
        "Dropout probability (0 for pretraining).",
        fix="use 0 for pretraining",
        ge=0,
        lt=1,
    )
    vocab_pad_multiple: int = _field(
        128,
        "Pad the embedding and output rows up to a multiple of this (GPU matmuls run "
        "fastest on multiples of 64-128); token ids are unchanged, the extra rows are never "
        "a target. 1 turns padding off. A base keeps its own row count.",
        fix="e.g. 128, or 1 for no padding",
        ge=1,
        le=4096,
    )

    attention: Literal["causal", "document"] | None = Field(
        None,
        description="How a token of a packed window attends: 'causal' (to every earlier token of "
        "the window, across documents) or 'document' (to the earlier tokens of its own document "
        "only, the boundaries at the token that ends each document, tokenizer.document_end; a "
        "fused flex-attention kernel on CUDA, an exact masked path on the CPU). Training and every "
        "evaluation mask alike. Empty: 'document' for a run from a base (model.init_from), else "
        "'causal'.",
        json_schema_extra={"fix": "give 'causal' or 'document', or leave it empty"},
        validate_default=True,
    )

    @field_validator("attention")
    @classmethod
    def _attention_default(cls, value: str | None, info: ValidationInfo) -> str:
        """Empty: 'document' for a run from a base (continued pretraining packs whole documents
        of long text), 'causal' otherwise (today's numerics, unchanged)."""
        if value is not None:
            return value
        return "document" if info.data.get("init_from") else "causal"

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """Without a base, an architecture field left out takes the family's default."""
        if isinstance(data, dict) and not data.get("init_from"):
            data = {**{k: v for k, v in cls.DEFAULTS.items()}, **{k: v for k, v in data.items() if v is not None}}
        return data

    # ---- the Hugging Face config.json of this family -------------------------------------
    @classmethod
    def hf_limits(cls, hf: dict) -> dict[str, Any]:
        """What a base's config.json bounds: max_positions (block_size may not exceed it),
        vocab_rows (the embedding rows), sliding_window (None: full attention)."""
        raise NotImplementedError

    @classmethod
    def from_hf_config(cls, hf: dict) -> dict[str, Any]:
        """This family's architecture fields from a Hugging Face config.json (a dict);
        UnsupportedArchitecture when the family cannot express it exactly."""
        raise NotImplementedError

    def to_hf_config(self, vocab_rows: int) -> dict[str, Any]:
        """A Hugging Face config.json for this model (``vocab_rows``: its embedding rows)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The model in a few words (`stoker runs`, the report)."""
        raise NotImplementedError

    def unresolved(self) -> list[str]:
        """Architecture fields still empty (a base not yet read)."""
        return [name for name in self.FROM_BASE if getattr(self, name) is None]


# ---- gpt2 -------------------------------------------------------------------------------------
class GPT2Config(_ModelSection):
    """nanoGPT's GPT: pre-norm blocks, learned positions, GELU MLP, tied embeddings."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"n_layer": 4, "n_head": 4, "n_embd": 128, "bias": False, "activation": "gelu"}
    FROM_BASE: ClassVar[tuple[str, ...]] = ("n_layer", "n_head", "n_embd", "bias", "activation")
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gpt2",)
    ROWS_ARE_THE_TOKENIZERS: ClassVar[bool] = True

    family: Literal["gpt2"] = Field("gpt2", description="Model family: 'gpt2' or 'llama'.")
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
        """What core.plan reads of this model (its Shape), counted from training.models.gpt2:
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


# ---- llama ------------------------------------------------------------------------------------
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

    family: Literal["llama"] = Field("llama", description="Model family: 'gpt2' or 'llama'.")
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
        """What core.plan reads of this model (its Shape), counted from training.models.llama:
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


FAMILIES: dict[str, type[_ModelSection]] = {"gpt2": GPT2Config, "llama": LlamaConfig}


def family_of_model_type(model_type: Any) -> str | None:
    """The family that reads a Hugging Face config.json of this model_type, or None."""
    return next((name for name, cls in FAMILIES.items() if model_type in cls.HF_MODEL_TYPES), None)


def _family_of(value: Any) -> str:
    """The union's tag: model.family, 'gpt2' when left out (configs older than the families)."""
    if isinstance(value, dict):
        return value.get("family") or "gpt2"
    return getattr(value, "family", "gpt2")


def _known_family(value: Any) -> Any:
    family = _family_of(value)
    if family not in FAMILIES:
        raise PydanticCustomError(
            "config_rule", f"family {family!r} is not a model family", {"fix": f"use one of {', '.join(FAMILIES)}"}
        )
    return value


class _AnyFamily:
    """The union's JSON schema as anyOf, not oneOf: a section that leaves model.family out (a
    gpt2 config older than the families) fits both members' schemas, and the Prefect server
    validates a deployment's parameters with that schema (oneOf would refuse it; pydantic's
    discriminator still picks exactly one family)."""

    def __get_pydantic_json_schema__(self, core_schema, handler):
        schema = handler(core_schema)
        if "oneOf" in schema:
            schema["anyOf"] = schema.pop("oneOf")
        return schema


# the model section: a union on model.family (the UI form and `config --list` show each
# family's fields)
ModelConfig = Annotated[
    Union[Annotated[GPT2Config, Tag("gpt2")], Annotated[LlamaConfig, Tag("llama")]],
    Discriminator(_family_of),
    _AnyFamily(),
]
