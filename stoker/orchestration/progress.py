"""The data stage's progress as it goes: a Prefect progress artifact per stage (units done of
total, documents per second, time left in its description) and a log line now and then; and,
once it is done, what each stage of each source took in and gave out (show_data_stages).

    progress = StageProgress("my-run")
    dedup.dedup_sources(..., on_progress=progress)   # stoker.data.units.Progress, per finished unit
"""

from __future__ import annotations

import re
import time

from stoker.orchestration.run_logger import run_logger

LOG_EVERY_S = 10.0  # a log line at most this often per stage (and at its end)
UPDATE_EVERY_S = 1.0  # the artifact's update, at most this often (and at its end)


def describe(p) -> str:
    """'12 of 40 units, 8,400 documents, 3,100 documents/s, about 21 s left' of a Progress."""
    eta = p.eta_s
    left = "done" if p.done == p.total else ("time left unknown" if eta is None else f"about {eta:.0f} s left")
    nodes = f", on {len(p.nodes)} node(s)" if p.nodes else ""
    return (
        f"{p.done} of {p.total} units, {p.docs:,} documents, {p.docs_per_s:,.0f} documents/s{nodes}, "
        f"{left} ({p.elapsed_s:.1f} s so far)"
    )


class StageProgress:
    """A callable for stoker.data.units.run_units' on_progress: one progress artifact per stage
    (keyed by run and stage), updated as units finish; a log line every LOG_EVERY_S."""

    def __init__(self, run: str | None):
        self.prefix = re.sub(r"[^a-z0-9-]", "-", (run or "data").lower())
        self.artifacts: dict[str, object] = {}
        self.last_update: dict[str, float] = {}
        self.last_log: dict[str, float] = {}

    def __call__(self, p) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.exceptions import MissingContextError

        now = time.monotonic()
        end = p.done == p.total
        share = 100.0 * p.done / max(1, p.total)
        text = f"{p.stage}: {describe(p)}"
        try:
            if p.stage not in self.artifacts:
                key = f"{self.prefix}-{re.sub(r'[^a-z0-9-]', '-', p.stage.lower())}"[:100]
                self.artifacts[p.stage] = create_progress_artifact(share, key=key, description=text)
                self.last_update[p.stage] = now
            elif end or now - self.last_update[p.stage] >= UPDATE_EVERY_S:
                update_progress_artifact(self.artifacts[p.stage], share, description=text)
                self.last_update[p.stage] = now
        except MissingContextError:  # called outside a flow run (a notebook calling the function)
            pass
        if end or now - self.last_log.get(p.stage, 0.0) >= LOG_EVERY_S:
            self.last_log[p.stage] = now
            run_logger("stoker.data").info(text)


def show_data_stages(shards, run: str | None) -> None:
    """Per source and stage of `shards` (stoker.contracts.results.DataShards) (download, dedup, tokenize), the documents and bytes in and out:
    a line each in the flow's log and the '{run}-data-stages' table artifact (the run's
    shards.json keeps the rows, for the report and `stoker runs`). Called in a flow."""
    from prefect.artifacts import create_table_artifact

    logger = run_logger()
    for line in shards.stage_lines():
        logger.info(line)
    create_table_artifact(
        shards.stage_rows(),
        key=f"{re.sub(r'[^a-z0-9-]', '-', (run or 'data').lower())}-data-stages"[:100],
        description="per source and stage: documents and bytes in and out, stored parts, tokens",
    )
