"""Deployments the real way: `prefect server start` on 127.0.0.1, `stoker deploy` (twice: it is
idempotent), a process worker, a run of the ad-hoc deployment with changed parameters, its
artifacts read back through the client, and a schedule that fires."""

import datetime
import os
import sys
import uuid

import pytest
import yaml

from stoker.core.config import RunConfig, load_config
from stoker.observe.ledger import deployment_ledgers, read_ledgers
from stoker.storage.store import Store
from tests.conftest import (
    ROOT,
    real_prefect_server,
    start_process,
    start_worker,
    stoker_deploy,
    stop_process,
    tiny_dict,
    wait_for,
    wait_for_flow_run,
)

PREFECT_YAML = os.path.join(ROOT, "prefect.yaml")


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One real `prefect server start` for this module's two tests (a start costs ~11 CPU
    seconds and, on a loaded machine, up to a minute): `stoker deploy` and the worker first,
    then `stoker serve`, which takes the deployments over from the work pool as it does after
    any deploy. Both tests are one xdist group, so they share it under `make test` too."""
    with real_prefect_server(str(tmp_path_factory.mktemp("deployments-prefect"))) as env:
        yield env


def test_prefect_yaml_train_parameters_are_the_tiny_cpu_recipe():
    """The deployments' defaults cannot drift from the recipe the README runs."""
    specs = {d["name"]: d for d in yaml.safe_load(open(PREFECT_YAML))["deployments"]}
    assert set(specs) == {"train-adhoc", "continued-pretraining", "prepare-data", "evaluate-checkpoint"}
    recipe = load_config("tiny-cpu").model_dump(mode="json")
    adhoc = RunConfig.model_validate(specs["train-adhoc"]["parameters"]["config"]).model_dump(mode="json")
    assert adhoc == recipe
    nightly = RunConfig.model_validate(specs["continued-pretraining"]["parameters"]["config"])
    assert nightly.run_name == "continued" and nightly.model_dump(mode="json") == {**recipe, "run_name": "continued"}
    assert specs["continued-pretraining"]["schedules"][0]["cron"] == "0 2 * * *"
    prep = specs["prepare-data"]["parameters"]
    assert {k: recipe["data"][k] for k in prep["data"]} == prep["data"]


@pytest.mark.e2e
@pytest.mark.xdist_group("deployments-server")
def test_deploy_then_a_worker_runs_the_adhoc_deployment_and_a_schedule_fires(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = {**prefect_api, "STOKER_ROOT": str(tmp_path / "store"), "STOKER_CACHE": str(tmp_path / "cache")}
    for round_ in (1, 2):  # idempotent: the second round finds the pool and the limit
        out = stoker_deploy(env)
        assert ("already there" in out) == (round_ == 2), out
    assert "deployment train-pipeline/train-adhoc: created or updated" in out

    worker_log = tmp_path / "worker.log"
    worker = start_worker(env, worker_log)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                deployments = {d.name: d for d in client.read_deployments()}
                assert set(deployments) == {
                    "train-adhoc",
                    "continued-pretraining",
                    "prepare-data",
                    "evaluate-checkpoint",
                }
                assert client.read_global_concurrency_limit_by_name("stoker-accelerators").limit == 1
                # the UI's form: every field with its description, choices, bounds
                schema = deployments["train-adhoc"].parameter_openapi_schema
                run_config = schema["definitions"]["RunConfig"]["properties"]
                assert set(run_config) >= {"data", "model", "train", "launch", "engine", "storage"}
                train = schema["definitions"]["TrainConfig"]["properties"]
                assert train["max_steps"]["description"] and train["max_steps"]["minimum"] == 1
                assert schema["definitions"]["EngineConfig"]["properties"]["parallelism"]["enum"] == ["ddp", "fsdp"]

            # an ad-hoc run with changed parameters, as "Custom run" in the UI does
            run_name = "adhoc-" + uuid.uuid4().hex[:6]
            params = tiny_dict("file://" + str(tmp_path / "store"), run_name=run_name)
            flow_run = run_deployment("train-pipeline/train-adhoc", parameters={"config": params}, timeout=0)
            with get_client(sync_client=True) as client:
                done = wait_for_flow_run(client, flow_run.id, "the ad-hoc run to finish", [worker_log])
                assert done.state.type == StateType.COMPLETED, done.state.message
                assert done.name == run_name and f"run:{run_name}" in done.tags
                artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
                keys = {a.key for a in artifacts if a.key}
                assert any(k.startswith(f"{run_name}-report-") for k in keys), keys
                assert any(k.startswith(f"{run_name}-checkpoints-") for k in keys), keys
            assert (tmp_path / "store" / "runs" / run_name / "checkpoints").is_dir()

            # a schedule fires: the nightly deployment, tiny parameters, due in a few seconds
            with get_client(sync_client=True) as client:
                nightly = deployments["continued-pretraining"]
                client.delete_deployment_schedule(nightly.id, nightly.schedules[0].id)
                # 20 s ahead: the server's scheduler (a pass every 2 s) must see the schedule before its
                # first run is due, or that run is an hour later (seen once, with the CI machine loaded)
                soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
                client.create_deployment_schedules(
                    nightly.id,
                    [(IntervalSchedule(interval=datetime.timedelta(hours=1), anchor_date=soon), True)],
                    parameters={
                        "config": tiny_dict(
                            "file://" + str(tmp_path / "store"), run_name="nightly", train={"max_steps": 4}
                        )
                    },
                )
                fired = wait_for(
                    "the scheduled run to finish",
                    lambda: [
                        r
                        for r in client.read_flow_runs(
                            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[nightly.id]))
                        )
                        if r.state and r.state.is_final()
                    ],
                    420,
                    [worker_log],
                )
                assert fired[0].state.type == StateType.COMPLETED, fired[0].state.message
                assert fired[0].auto_scheduled

            # the ledger summed per deployment: each of the two runs under its own deployment
            store = Store("file://" + str(tmp_path / "store"))
            totals = deployment_ledgers(store)
            assert {name: t["runs"] for name, t in totals.items()} == {
                "train-adhoc": [run_name],
                "continued-pretraining": ["nightly"],
            }
            for name, run in (("train-adhoc", run_name), ("continued-pretraining", "nightly")):
                (one,) = read_ledgers(store, run)
                assert one["deployment"] == name and totals[name]["num_flow_runs"] == 1
                assert totals[name]["wall_seconds"] == pytest.approx(one["wall_seconds"]) and one["wall_seconds"] > 0
                assert totals[name]["seconds"] == pytest.approx(
                    {c: one["seconds"].get(c, 0.0) for c in totals[name]["seconds"]}
                )
    finally:
        stop_process(worker)


@pytest.mark.e2e
@pytest.mark.xdist_group("deployments-server")
def test_serve_runs_the_deployments_from_one_process_without_a_worker(prefect_api, tmp_path):
    """`stoker serve`: the four deployments served by a runner in this one process (no work
    pool, no worker); a run of the ad-hoc one with tiny parameters completes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = {**prefect_api, "STOKER_ROOT": str(tmp_path / "store"), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    # the module's server: the deploy test's pooled deployments (when it ran first) are there
    # until serve has replaced them with deployments of its own
    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            before = {d.id for d in client.read_deployments()}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        served = start_process([sys.executable, "-m", "stoker.cli", "serve"], env, out)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                deployments = wait_for(
                    "the served deployments",
                    lambda: (lambda ds: ds if len(ds) == 4 and not {d.id for d in ds} & before else None)(
                        client.read_deployments()
                    ),
                    180,
                    [log],
                )
                assert {d.name for d in deployments} == {
                    "train-adhoc",
                    "continued-pretraining",
                    "prepare-data",
                    "evaluate-checkpoint",
                }
                assert all(d.work_pool_name is None for d in deployments)  # served, not pooled
                nightly = next(d for d in deployments if d.name == "continued-pretraining")
                assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
            params = tiny_dict("file://" + str(tmp_path / "store"), run_name="served")
            flow_run = run_deployment("train-pipeline/train-adhoc", parameters={"config": params}, timeout=0)
            with get_client(sync_client=True) as client:
                done = wait_for_flow_run(client, flow_run.id, "the served run to finish", [log])
            assert done.state.type == StateType.COMPLETED, done.state.message
            assert done.name == "served"
    finally:
        stop_process(served)
