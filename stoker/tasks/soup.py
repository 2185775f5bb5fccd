"""Prefect tasks of the soup flow: check the soup, pin its run folder, make it (once), report.
The work lives in storage.soups, launch.soup (the torch process) and observe.soups."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from stoker.contracts.results import EvalResult
from stoker.contracts.soups import SoupResult
from stoker.launch.soup import run_soup
from stoker.observe.soups import base_record, rounded_rows, soup_markdown, soup_rows
from stoker.storage import soups
from stoker.storage.store import Store
from stoker.tasks.policy import stoker_task
from stoker.tasks.report import artifact_key


@stoker_task(name="plan_soup", retries=2)
def plan_soup(
    checkpoints: list[str],
    weights: list[float] | None,
    run_name: str | None,
    root: str | None,
    storage_options: dict,
    last: int | None,
    steps: str | None,
    across_decay: bool,
) -> soups.SoupPlan:
    """Every check of the soup before any compute (storage.soups.resolve_soup: each input
    committed and intact, every checksum read; one model, tokenizer and vocabulary; the weights;
    a run's window of one phase): one ConfigError line per problem, never retried."""
    plan = soups.resolve_soup(
        checkpoints,
        weights,
        run_name,
        root=root,
        storage_options=storage_options,
        last=last,
        steps=steps,
        across_decay=across_decay,
    )
    logger = get_run_logger()
    for i in plan.inputs:
        logger.info(
            "soup %s: %s at step %d, weight %.4g (sha256 %s)", plan.run_name, i.run, i.step, i.weight, i.sha256[:12]
        )
    return plan


@stoker_task(name="pin_soup_folder", retries=3)
def pin_soup_folder(plan: soups.SoupPlan) -> str:
    """The soup run's folder (lineage.json, config.json, the lead's tokenizer and shards.json);
    its config URL."""
    return soups.pin_soup_folder(Store(plan.root, plan.storage_options), plan)


@stoker_task(name="make_soup", retries=2)
def make_soup(plan: soups.SoupPlan) -> tuple[str, bool]:
    """(checkpoint key, computed) of the soup: a soup already committed under its run (its
    manifest names this soup's identity) is taken as it is, with no process; else the soup
    process averages the inputs and commits the checkpoint."""
    store = Store(plan.root, plan.storage_options)
    found = soups.soup_checkpoint(store, plan)
    logger = get_run_logger()
    if found is not None:
        logger.info("soup %s was made before: %s (nothing recomputed)", plan.run_name, store.url(found))
        return found, False
    done = run_soup(plan)
    logger.info(
        "soup %s: %d tensors averaged (of %d), %.1f MB written in %.1fs: %s",
        plan.run_name,
        done.num_averaged,
        done.num_tensors,
        done.bytes_written / 1e6,
        done.seconds,
        done.checkpoint,
    )
    return done.key, True


@stoker_task(name="soup_report")
def soup_report(
    plan: soups.SoupPlan, key: str, computed: bool, evaluation: EvalResult, inputs: list[EvalResult]
) -> SoupResult:
    """The soup's report (a markdown artifact and a table): per source, the soup's loss and
    bits per byte beside each input's and the base's."""
    store = Store(plan.root, plan.storage_options)
    labels = [f"{i.run}@{i.step}" for i in plan.inputs]
    rows = soup_rows(labels, inputs, evaluation, base_record(store, plan.run_name))
    lineage = plan.lineage()
    create_table_artifact(
        rounded_rows(rows),
        key=artifact_key(plan.run_name, "soup"),
        description=f"{plan.run_name}: per source, the soup's validation loss and bits per byte beside each input's and the base's",
    )
    create_markdown_artifact(
        key=artifact_key(plan.run_name, "report"),
        description=f"summary of soup {plan.run_name}",
        markdown=soup_markdown(plan.run_name, lineage, rows, computed, store.url(key)),
    )
    return SoupResult(
        run_name=plan.run_name,
        soup_id=plan.soup_id,
        checkpoint_uri=store.url(key),
        checkpoint_key=key,
        step=plan.step,
        computed=computed,
        lineage=lineage,
        evaluation=evaluation,
        inputs=inputs,
        rows=rows,
    )
