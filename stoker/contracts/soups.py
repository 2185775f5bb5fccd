"""What the soup flow returns (SoupResult); the soup process's record is ``events.Souped``."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stoker.contracts import events
from stoker.contracts.results import EvalResult

Souped = events.Souped  # the soup process's record, beside the rank records' kinds


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
