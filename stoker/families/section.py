"""What every model family's config section shares (torch-free): where the weights come from,
the context, the padding, the attention mode, and the questions each family answers.

A family's section (``families/<name>/config.py``) declares its architecture fields and
answers: the mapping of a Hugging Face ``config.json`` to and from its fields
(``from_hf_config`` / ``to_hf_config``), so the flow process can read a base and the export can
write one without torch; its parameter count and activation shape (``plan_shape``), from which
the plan and the trainer's FLOPs per token are both counted (``flops_per_token``); and which of
its sizes a tensor-parallel split divides (``tp_split_sizes``, with ``TENSOR_PARALLEL``).

The architecture fields default to None, meaning "the base's value" when ``model.init_from``
names a base, and the family's own default otherwise (filled when the section is built). A
value given explicitly that contradicts the base's config.json is refused, naming both
values (``storage.bases.resolve_base``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from stoker.fields import _field, _rule, _Section  # noqa: F401 (the families' sections use them)


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

    @property
    def resolved_head_dim(self) -> int:
        """The width of one attention head: n_embd / n_head (a family with a head_dim field
        overrides this)."""
        return self.n_embd // self.n_head

    def unresolved(self) -> list[str]:
        """Architecture fields still empty (a base not yet read)."""
        return [name for name in self.FROM_BASE if getattr(self, name) is None]

    def plan_shape(self, vocab_rows: int) -> dict[str, int]:
        """What the plan reads of this model (``arithmetic.plan.Shape``): the parameters by part, the
        widths FLOPs count and the activations a block keeps, counted from the family's module
        (the family's tests check the count against the module's parameters)."""
        raise NotImplementedError

    def flops_per_token(self, vocab_rows: int) -> float:
        """Training FLOPs per token: 6N for the matmuls of forward and backward (N without an
        untied input embedding, a lookup) plus 12·L·(query width)·T for attention (PaLM
        appendix B). The plan and the trainer's MFU both read this one count."""
        s = self.plan_shape(vocab_rows)
        return 6 * s["matmul_params"] + 12 * s["layers"] * s["attention_width"] * s["block"]

    def tp_split_sizes(self) -> list[tuple[str, int | None]]:
        """The sizes a tensor-parallel split of this family divides (each rank holds
        1/tp_degree of each): empty for a family without a plan (``TENSOR_PARALLEL``)."""
        return []
