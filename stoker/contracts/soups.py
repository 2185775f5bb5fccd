"""The soup process's record (training.soup_main), in the rank records' wire format: a Souped
event, registered with the other kinds so that ``events.decode`` reads it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, Field

from stoker.contracts import events
from stoker.contracts.results import EvalResult


@dataclass(frozen=True, kw_only=True)
class Souped(events.Event):
    """What a soup process committed: the soup run's first checkpoint."""

    kind: ClassVar[str] = "souped"
    checkpoint: str  # its URI
    key: str  # under the store root
    step: int
    soup_id: str
    num_tensors: int
    num_averaged: int  # model tensors and AdamW moments; the rest is the lead's
    largest_tensor_bytes: int
    bytes_written: int
    seconds: float


events.TYPES.setdefault(Souped.kind, Souped)


class SoupResult(BaseModel):
    """What the soup flow returns: the soup run, its checkpoint, and how it compares."""

    run_name: str
    soup_id: str
    checkpoint_uri: str
    checkpoint_key: str
    step: int
    computed: bool = Field(description="False: this soup was made before; nothing was recomputed")
    lineage: dict
    evaluation: EvalResult | None = None
    inputs: list[EvalResult] = Field(default_factory=list, description="each input's evaluation, in input order")
    rows: list[dict] = Field(default_factory=list, description="per source: base, each input and the soup")
