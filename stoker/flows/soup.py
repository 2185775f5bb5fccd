"""The soup flow: committed checkpoints of runs or branches of one model, averaged into the
first checkpoint of a new run, evaluated (with each input, on the same sets), reported.

from stoker.flows.soup import soup
result = soup(["{root}/runs/a/checkpoints/step-00000260", "{root}/runs/b/checkpoints/step-00000260"])
result = soup(["my-run"], last=3)   # a run's own newest 3 checkpoints, of one phase
"""

# no `from __future__ import annotations`: a served flow resolves its parameter types at run time
from prefect import flow

from stoker.contracts.soups import SoupResult
from stoker.flows import fails_in_one_line
from stoker.flows.runs import claim_flow_run, results_of, tag_flow_run
from stoker.orchestration.credentials import use_credentials_block
from stoker.tasks.evaluation import evaluate_checkpoint
from stoker.tasks.lease import run_lease
from stoker.tasks.soup import make_soup, pin_soup_folder, plan_soup, soup_report


@flow(name="soup", log_prints=True)
@fails_in_one_line
def soup(
    checkpoints: list[str],
    weights: list[float] | None = None,
    run_name: str | None = None,
    last: int | None = None,
    steps: str | None = None,
    across_decay: bool = False,
    root: str | None = None,
    storage_options: dict | None = None,
    credentials_block: str | None = None,
) -> SoupResult:
    """Average committed checkpoints (URIs; or one run's name with `last` K or `steps` 'a..b')
    with `weights` (uniform when empty; they sum to 1) into the first checkpoint of a new run
    (`run_name`, default soup-<its identity>), then evaluate it and each input and report, per
    source, the soup beside its inputs and the base. The same soup twice is one run: nothing is
    recomputed. `root`: the store of a run named by `last`/`steps`."""
    claim_flow_run()  # its owner process, so a dead one's run ends Crashed, not Running
    use_credentials_block(credentials_block)
    plan = plan_soup(checkpoints, weights, run_name, root, storage_options or {}, last, steps, across_decay)
    tag_flow_run(f"run:{plan.run_name}", "soup")
    with run_lease(plan.config):  # one writer per run
        config_url = pin_soup_folder(plan)
        key, computed = make_soup(plan)
        shard_key = plan.lead_manifest.get("shard_key") or ""
        evaluation = evaluate_checkpoint.submit(plan.config, config_url, key, shard_key)
        inputs = [evaluate_checkpoint.submit(plan.config, config_url, i.key, shard_key) for i in plan.inputs]
        evaluated, inputs = results_of([evaluation])[0], results_of(inputs)
    return soup_report(plan, key, computed, evaluated, inputs)
