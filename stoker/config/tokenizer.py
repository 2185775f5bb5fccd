"""The tokenizer section (``TokenizerConfig``): the byte-level BPE trained on the corpus, or a
tokenizer.json loaded, and the token that ends each document."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from stoker.fields import NonBlank, _field, _Section


class TokenizerConfig(_Section):
    path: str | None = Field(
        None,
        description="A tokenizer.json to load instead of training one (local path or URL).",
    )
    vocab_size: int = _field(
        2048,
        "Vocabulary size of the byte-level BPE trained on the corpus; with 'path', "
        "at least the loaded tokenizer's size (it sizes the model's embedding).",
        fix="room for the 256 byte tokens plus specials, within uint32 ids; e.g. 2048",
        ge=260,
        le=2**32 - 1,
    )
    min_frequency: int = _field(2, "Minimum pair frequency for a BPE merge.", fix="2 is typical", ge=1)
    eot_token: NonBlank = _field(
        "<|endoftext|>",
        "End-of-text special token that ends every document in the shards.",
        fix="use the tokenizer's end-of-text token, e.g. '<|endoftext|>'",
    )
    document_end: str | None = _field(
        None,
        "The token that ends each document in the packed windows (the boundary model.attention "
        "'document' masks at). Empty: with a base, its end-of-text token: its eos, or, where its "
        "eos ends a chat turn (<|im_end|>, <|eot_id|>) and its vocabulary has an end-of-text "
        "token (<|endoftext|>, <|end_of_text|>), that one; without a base, eot_token. Set, it "
        "must be a token of the vocabulary.",
        fix="give a token of the tokenizer's vocabulary, e.g. '<|endoftext|>', or leave it empty",
        min_length=1,
    )

    @model_validator(mode="before")
    @classmethod
    def _document_end_is_the_eot(cls, data: Any) -> Any:
        """A document_end given without a base is the token a trained tokenizer ends documents
        with (eot_token); with a base, resolve_base reads it against the base's vocabulary."""
        if isinstance(data, dict) and data.get("document_end") and not data.get("path"):
            data = {**data, "eot_token": data["document_end"]}
        return data
