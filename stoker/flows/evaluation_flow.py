"""Evaluate any committed checkpoint of a run, as a flow of its own."""

from __future__ import annotations

from prefect import flow

from stoker.contracts.results import EvalResult
from stoker.flows import fails_in_one_line
from stoker.flows.runs import claim_flow_run
from stoker.tasks.evaluation import checkpoint_inputs, evaluate_checkpoint


@flow(name="evaluate-checkpoint")
@fails_in_one_line
def evaluate_checkpoint_flow(
    checkpoint_uri: str, storage_options: dict | None = None, credentials_block: str | None = None
) -> EvalResult:
    """Validation loss and perplexity of the checkpoint at `checkpoint_uri`
    (``{root}/runs/{run}/checkpoints/step-...``), using the run's own config and shards.
    A checkpoint already evaluated (same commit manifest, same eval settings) is not evaluated
    again: its evaluate_checkpoint task run shows Cached and returns the stored result.
    credentials_block: a Prefect block with the store's credentials (see
    storage.credentials_block); empty: the environment's."""
    claim_flow_run()  # its owner process, so a dead one's run ends Crashed, not Running
    config, config_url, checkpoint_key, shard_key = checkpoint_inputs(
        checkpoint_uri, storage_options or {}, credentials_block
    )
    return evaluate_checkpoint(config, config_url, checkpoint_key, shard_key)
