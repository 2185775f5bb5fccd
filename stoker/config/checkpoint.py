"""The checkpoint section (``CheckpointConfig``): how often a run saves, how many committed
checkpoints it keeps, and how long an upload and a commit may take."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from stoker.fields import _field, _rule, _Section


class CheckpointConfig(_Section):
    interval_steps: int = _field(
        100,
        "Steps between checkpoints (the last step always saves, and so does the step where a 'wsd' decay begins).",
        ge=1,
    )
    keep_latest_k: int = _field(
        2,
        "Committed checkpoints to keep; at least 2, as the newest may still be uploading.",
        fix="keep at least 2, as the newest may still be uploading",
        ge=2,
    )
    async_enabled: bool = Field(
        True,
        description="Upload in the background while training goes on (False: the step "
        "waits for save, upload and commit).",
    )
    upload_timeout_seconds: float = _field(
        900.0,
        "How long one rank keeps retrying (with backoff) its upload of one "
        "checkpoint before the checkpoint is given up (reported, never committed).",
        fix="e.g. 900",
        gt=0,
    )
    commit_timeout_seconds: float = _field(
        1200.0,
        "How long rank 0 waits for every rank's upload receipt before it gives the checkpoint up.",
        fix="give at least upload_timeout_seconds, e.g. 1200",
        gt=0,
    )
    max_pending_uploads: int = _field(
        2,
        "Checkpoints written to local staging and waiting for their upload (an object-store "
        "outage): when a new one is written while this many wait, the oldest waiting one that "
        "has not started its upload is dropped (its staging deleted, a checkpoint_dropped "
        "record, never committed), so the local disk holds at most this many (one more at 1, "
        "while one uploads) and training never waits for the store. The upload under way is "
        "never dropped, so a store slower than the checkpoints still commits every other one.",
        fix="give at least 1, e.g. 2 (each costs one checkpoint of local disk per host)",
        ge=1,
    )
    evaluation_pin_seconds: float = _field(
        7200.0,
        "With eval.per_checkpoint_enabled, each committed checkpoint is pinned until its "
        "evaluation is done, and retention (keep_latest_k) spares it meanwhile; a pin older than "
        "this (an evaluation that died) no longer keeps it.",
        fix="give more than an evaluation takes with its retries, e.g. 7200",
        gt=0,
    )

    @field_validator("commit_timeout_seconds")
    @classmethod
    def _commit_outwaits_upload(cls, commit: float, info: ValidationInfo) -> float:
        upload = info.data.get("upload_timeout_seconds")
        if upload is not None and commit < upload:
            raise _rule(f"must be >= upload_timeout_seconds={upload}")
        return commit
