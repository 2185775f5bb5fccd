"""Deployments the real way: `prefect server start` on 127.0.0.1, `stoker deploy` (twice: it is
idempotent), a process worker, a run of the ad-hoc deployment with changed parameters, its
artifacts read back through the client, a schedule that fires, the evaluate-checkpoint
automation that deploy keeps (a committed checkpoint of that same run is evaluated by it), a
custom run started from the UI's form in a real browser, and `stoker serve` after deploy on the
same server. One server, one deploy and one worker for all of them (the module is one xdist
group; its tests run in this order)."""

import base64
import datetime
import os
import re
import sys
import uuid
from types import SimpleNamespace

import httpx
import pytest
import yaml

from stoker.config import RunConfig, load_config
from stoker.observe import prefect_events as pe
from stoker.observe.ledger import deployment_ledgers, read_ledgers
from stoker.orchestration.prefect_events import EVALUATE_AUTOMATION
from stoker.storage.store import Store
from tests.conftest import (
    ROOT,
    real_prefect_server,
    start_process,
    start_worker,
    stoker_deploy,
    stoker_events,
    stop_process,
    stop_worker,
    tiny_dict,
    wait_for,
    wait_for_flow_run,
)
from tests.flows import browser

PREFECT_YAML = os.path.join(ROOT, "prefect.yaml")
# the one field the UI test's form changes (the recipe says 500); above warmup_steps (20), as it must be
UI_MAX_STEPS = 24
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled")


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One real `prefect server start` for this module's tests (a start costs ~10 CPU
    seconds and, on a loaded machine, up to a minute): `stoker deploy` and the worker first,
    then `stoker serve`, which takes the deployments over from the work pool as it does after
    any deploy. The tests are one xdist group, so they share it under `make test` too."""
    with real_prefect_server(str(tmp_path_factory.mktemp("deployments-prefect"))) as env:
        yield env


@pytest.fixture(scope="module")
def deployed(prefect_api, tmp_path_factory):
    """`stoker deploy` twice on the module's server (the second finds everything by its name),
    and a process worker on its pool (started once the first deploy made the pool: the
    worker's start-up runs beside the second deploy): `env`, `store` (the runs' root), the two
    deploys' outputs `outs` and the worker's log."""
    folder = tmp_path_factory.mktemp("deployed")
    store = folder / "store"
    env = {**prefect_api, "STOKER_ROOT": str(store), "STOKER_CACHE": str(folder / "cache")}
    outs = [stoker_deploy(env)]
    worker_log = folder / "worker.log"
    worker = start_worker(env, worker_log)
    try:
        outs.append(stoker_deploy(env))
        yield SimpleNamespace(env=env, store=store, outs=outs, worker_log=worker_log)
    finally:
        stop_worker(worker)


@pytest.fixture(scope="module")
def nightly_schedule(prefect_api, deployed):
    """The nightly deployment's schedule replaced by one due 20 s from now, with tiny
    parameters: made before the ad-hoc run starts, so the lead the scheduler needs passes while
    that run trains (the worker runs the fired run beside it; its launch waits for the
    accelerator slot). The deploy test waits for it and checks it. The nightly's id."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("train-pipeline/continued-pretraining")
        client.delete_deployment_schedule(nightly.id, nightly.schedules[0].id)
        # 20 s ahead: the server's scheduler (a pass every 2 s) must see the schedule before its
        # first run is due, or that run is an hour later (seen once, with the CI machine loaded)
        soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=20)
        client.create_deployment_schedules(
            nightly.id,
            [(IntervalSchedule(interval=datetime.timedelta(hours=1), anchor_date=soon), True)],
            # one rank: the schedule and the ledger are the subject, not the gang
            parameters={
                "config": tiny_dict(
                    "file://" + str(deployed.store),
                    run_name="nightly",
                    train={"max_steps": 4},
                    launch={"nproc_per_node": 1},
                )
            },
        )
    return nightly.id


@pytest.fixture(scope="module")
def adhoc_run(prefect_api, deployed, nightly_schedule):
    """One run of the ad-hoc deployment with tiny parameters, run by the worker to its end (as
    "Custom run" in the UI makes one): checkpoints at steps 4 and 8. Its artifacts, ledger
    and checkpoint events are read by the deploy test and the evaluate-automation test. (The
    nightly's schedule is made first: nightly_schedule.)"""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = "adhoc-" + uuid.uuid4().hex[:6]
    # one rank: the deployment, its worker and its checkpoints are the subject, not the gang
    params = tiny_dict("file://" + str(deployed.store), run_name=name, launch={"nproc_per_node": 1})
    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
        flow_run = run_deployment("train-pipeline/train-adhoc", parameters={"config": params}, timeout=0)
        with get_client(sync_client=True) as client:
            done = wait_for_flow_run(client, flow_run.id, "the ad-hoc run to finish", [deployed.worker_log])
    return SimpleNamespace(name=name, id=flow_run.id, done=done)


def test_prefect_yaml_train_parameters_are_the_tiny_cpu_recipe():
    """The deployments' defaults cannot drift from the recipe the README runs."""
    specs = {d["name"]: d for d in yaml.safe_load(open(PREFECT_YAML))["deployments"]}
    assert set(specs) == {"train-adhoc", "continued-pretraining", "prepare-data", "evaluate-checkpoint", "soup"}
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
def test_deploy_then_a_worker_runs_the_adhoc_deployment_and_a_schedule_fires(
    prefect_api, deployed, nightly_schedule, adhoc_run
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for round_, out in enumerate(deployed.outs, 1):  # idempotent: the second round finds the pool and the limit
        assert ("already there" in out) == (round_ == 2), out
    assert "deployment train-pipeline/train-adhoc: created or updated" in out

    worker_log, store = deployed.worker_log, deployed.store
    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            deployments = {d.name: d for d in client.read_deployments()}
            assert set(deployments) == {
                "train-adhoc",
                "continued-pretraining",
                "prepare-data",
                "evaluate-checkpoint",
                "soup",
            }
            assert client.read_global_concurrency_limit_by_name("stoker-accelerators").limit == 1
            # the UI's form: every field with its description, choices, bounds
            schema = deployments["train-adhoc"].parameter_openapi_schema
            run_config = schema["definitions"]["RunConfig"]["properties"]
            assert set(run_config) >= {"data", "model", "train", "launch", "engine", "storage"}
            train = schema["definitions"]["TrainConfig"]["properties"]
            assert train["max_steps"]["description"] and train["max_steps"]["minimum"] == 1
            assert schema["definitions"]["EngineConfig"]["properties"]["parallelism"]["enum"] == [
                "ddp",
                "fsdp",
                "fsdp+tp",
            ]

            # the ad-hoc run with changed parameters (the module's), run by the worker
            run_name, done = adhoc_run.name, adhoc_run.done
            assert done.state.type == StateType.COMPLETED, done.state.message
            assert done.name == run_name and f"run:{run_name}" in done.tags
            artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id={"any_": [adhoc_run.id]}))
            keys = {a.key for a in artifacts if a.key}
            assert any(k.startswith(f"{run_name}-report-") for k in keys), keys
            assert any(k.startswith(f"{run_name}-checkpoints-") for k in keys), keys
            assert (store / "runs" / run_name / "checkpoints").is_dir()

            # a schedule fires: the nightly deployment, tiny parameters, due 20 s after it was
            # made (nightly_schedule, before the ad-hoc run)
            nightly = deployments["continued-pretraining"]
            assert nightly.id == nightly_schedule
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
    totals = deployment_ledgers(Store("file://" + str(store)))
    assert {name: t["runs"] for name, t in totals.items()} == {
        "train-adhoc": [run_name],
        "continued-pretraining": ["nightly"],
    }
    for name, run in (("train-adhoc", run_name), ("continued-pretraining", "nightly")):
        (one,) = read_ledgers(Store("file://" + str(store)), run)
        assert one["deployment"] == name and totals[name]["num_flow_runs"] == 1
        assert totals[name]["wall_seconds"] == pytest.approx(one["wall_seconds"]) and one["wall_seconds"] > 0
        assert totals[name]["seconds"] == pytest.approx(
            {c: one["seconds"].get(c, 0.0) for c in totals[name]["seconds"]}
        )


@pytest.mark.e2e
@pytest.mark.xdist_group("deployments-server")
def test_deploy_keeps_the_evaluate_automation_and_a_committed_checkpoint_is_evaluated_by_it(
    prefect_api, deployed, adhoc_run
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.events import Event
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for round_, out in enumerate(deployed.outs, 1):  # idempotent: the second finds the automation by its name
        said = "created" if round_ == 1 else "already there (updated)"
        assert f"automation {EVALUATE_AUTOMATION!r}: {said}" in out, out

    # the module's ad-hoc run: checkpoints at steps 4 and 8; the run evaluates step 8 itself
    # (its last), the automation step 4
    store, worker_log, run, done = deployed.store, deployed.worker_log, adhoc_run.name, adhoc_run.done
    step4 = f"file://{store}/runs/{run}/checkpoints/step-00000004"
    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        automations = client.read_automations_by_name(EVALUATE_AUTOMATION)
        assert len(automations) == 1
        evaluate = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
        action = automations[0].actions[0]
        assert action.type == "run-deployment" and action.deployment_id == evaluate.id
        assert done.state.type == StateType.COMPLETED, done.state.message

        def evaluations():
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["evaluate-checkpoint"]))
            )
            return runs if runs and all(r.state.is_final() for r in runs) else None

        runs = wait_for("the automation's evaluation to finish", evaluations, 300, [worker_log])
        assert len(runs) == 1, [(r.name, r.parameters) for r in runs]
        assert runs[0].parameters == {"checkpoint_uri": step4}
        assert runs[0].state.type == StateType.COMPLETED, runs[0].state.message

        committed = wait_for(
            "both checkpoint events",
            lambda: (lambda es: es if len(es) == 2 else None)(stoker_events(prefect_api, pe.CHECKPOINT_COMMITTED, run)),
            60,
        )
        assert [e["resource"]["stoker.checkpoint.step"] for e in committed] == ["4", "8"]
        first = committed[0]
        assert first["resource"]["prefect.resource.id"] == f"stoker.checkpoint.{run}.4"
        assert first["resource"][pe.URI_LABEL] == step4 and len(first["resource"][pe.MANIFEST_LABEL]) == 64
        assert first["resource"]["stoker.deployment.id"] == str(done.deployment_id)
        related = {r["prefect.resource.id"] for r in first["related"]}
        assert {
            f"prefect.flow-run.{adhoc_run.id}",
            f"prefect.deployment.{done.deployment_id}",
            f"stoker.run.{run}",
        } <= related
        assert stoker_events(prefect_api, pe.RUN_STEP, run), "no heartbeat"
        assert not stoker_events(prefect_api, pe.RUN_FAILED, run)

        # the same checkpoint's event a second time (a replayed event, a second trigger): the
        # automation runs the deployment again, and its evaluation is Cached (keyed by the
        # checkpoint's manifest): no second evaluation process, the same numbers
        # (posted to the server's events API: this process's EventsWorker may still be bound
        # to another server of the session)
        again_event = Event(event=pe.CHECKPOINT_COMMITTED, resource=first["resource"], related=first["related"])
        posted = httpx.post(
            prefect_api["PREFECT_API_URL"] + "/events", json=[again_event.model_dump(mode="json")], timeout=30
        )
        assert posted.status_code == 204, posted.text
        again = wait_for(
            "the second evaluation to finish",
            lambda: (lambda rs: rs if len(rs) == 2 else None)(evaluations() or []),
            300,
            [worker_log],
        )
        second = max(again, key=lambda r: r.expected_start_time)
        assert second.id != runs[0].id and second.parameters == {"checkpoint_uri": step4}
        assert second.state.type == StateType.COMPLETED, second.state.message

        def task_states():  # task run states reach the database as events, a little later
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[second.id])))
            states = {t.name.rsplit("-", 1)[0]: t.state for t in tasks if t.state is not None}
            done = states.get("evaluate_checkpoint")
            return states if done is not None and done.is_final() else None

        states = wait_for("the second evaluation's task runs", task_states, 60, [worker_log])
        assert states["evaluate_checkpoint"].name == "Cached", states


# after the ad-hoc run's tests (its run would add to their ledger and evaluations) and before
# `stoker serve` (which takes the deployments over from the worker)
@pytest.mark.e2e
@pytest.mark.xdist_group("deployments-server")
def test_custom_run_from_the_ui_form_completes_and_its_page_shows_report_and_loss_curve(
    prefect_api, deployed, tmp_path
):
    """The Prefect UI in a real browser: Debian's Chromium driven by Playwright opens the UI of
    the module's server, starts a custom run of `train-pipeline/train-adhoc` from the
    deployment's form with one field changed (train.max_steps), which the module's worker
    runs; it waits on the run page until the run is Completed, and checks that the run's
    artifacts show the report with its loss curve (the data-URI image decoded by the browser,
    the very PNG of the run folder) and the checkpoint table. Screenshots of every step are
    kept under the test's tmp_path."""
    sync_api = browser.playwright()
    store, worker_log = deployed.store, deployed.worker_log
    base = prefect_api["PREFECT_API_URL"].removesuffix("/api")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    recipe = load_config("tiny-cpu").model_dump(mode="json")
    expected = load_config("tiny-cpu", train__max_steps=UI_MAX_STEPS)
    run = expected.resolved_run_name()
    taken: list[str] = []

    def shot(page, name, **kw):
        path = str(shots / f"{len(taken) + 1:02d}-{name}.png")
        (kw.pop("element", None) or page).screenshot(path=path, **kw)
        taken.append(path)

    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=browser.CHROMIUM, args=browser.CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(90_000)  # pages can take 20-40 s headless on 2 cores
        try:
            # the deployment, from the list of deployments
            page.goto(base + "/deployments")
            page.get_by_role("link", name="train-adhoc").first.click()
            page.get_by_text("Entrypoint").wait_for()
            shot(page, "deployment")

            # Run > Custom run: the form, with the recipe's values
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            page.get_by_role("button", name="Submit").wait_for()
            max_steps = browser.form_input(page, "Max Steps (Optional)")
            assert max_steps.count() == 1
            assert max_steps.input_value() == str(recipe["train"]["max_steps"])
            assert page.get_by_text("Optimizer steps to train in total (across resumes).").count() == 1
            max_steps.fill(str(UI_MAX_STEPS))
            max_steps.scroll_into_view_if_needed()
            shot(page, "custom-run-form")

            # Submit: the browser's own request creates the flow run. A 503 is the
            # server's "try again" (its SQLite was busy: seen once under load, the cause in
            # server.log); the form stays, and a user presses Submit again, as the test does
            for attempt in range(3):
                with page.expect_response(
                    lambda r: r.url.endswith("/create_flow_run") and r.request.method == "POST"
                ) as created:
                    page.get_by_role("button", name="Submit").click()
                if created.value.status != 503:
                    break
                shot(page, f"submit-answered-503-{attempt}")
                browser.dismiss_toasts(page, appear_within_ms=10_000)
            assert created.value.ok, created.value.text()
            flow_run = created.value.json()
            submitted = RunConfig.model_validate(flow_run["parameters"]["config"])
            # exactly one field differs from the recipe
            assert submitted.model_dump(mode="json") == expected.model_dump(mode="json")
            run_id = flow_run["id"]

            # the toast's "View run" (two toast layers: the top one takes the click); the
            # toast lasts 5 s, so on a slow page go to the run's address instead
            try:
                page.get_by_role("button", name="View run").last.click(timeout=4_000)
            except sync_api.TimeoutError:
                page.goto(f"{base}/runs/flow-run/{run_id}")
            page.wait_for_url(re.compile(f"/runs/flow-run/{run_id}"))
            badge = page.locator("header.page-heading-flow-run .state-badge")
            badge.wait_for()
            shot(page, "run-started")

            # the run page follows the run until it ends
            page.wait_for_function(
                "states => { const b = document.querySelector("
                "'header.page-heading-flow-run .state-badge');"
                " return b && states.includes(b.innerText.trim()); }",
                arg=list(FINAL_STATES),
                timeout=360_000,
                polling=1000,
            )
            state = badge.inner_text().strip()
            shot(page, "run-finished")
            assert state == "Completed", (state, open(worker_log).read()[-4000:])
            heading = page.locator("header.page-heading-flow-run")
            sync_api.expect(heading.locator(".p-bread-crumbs__crumb").last).to_have_text(run)
            sync_api.expect(heading.get_by_text(f"run:{run}", exact=True)).to_be_visible()

            # its Artifacts tab: the report, the checkpoint table, the progress
            browser.dismiss_toasts(page)  # an error toast (a 503 under load) stays and covers cards
            page.locator("li.p-tab#artifacts").click()
            titles = page.locator(".artifact-card__title")
            report_key, table_key = f"{run}-report-{run_id[:8]}", f"{run}-checkpoints-{run_id[:8]}"
            for key in (report_key, table_key, f"{run}-progress-{run_id[:8]}"):
                sync_api.expect(titles.filter(has_text=key)).to_have_count(1)
            shot(page, "run-artifacts")

            # the report, rendered: its text and the loss curve as a decoded image
            titles.filter(has_text=report_key).click()
            page.wait_for_url(re.compile("/artifacts/artifact/"))
            report = page.locator("article.markdown-renderer").filter(has=page.get_by_role("heading", name="Loss"))
            sync_api.expect(report.get_by_role("heading", name=run, exact=True)).to_be_visible()
            sync_api.expect(report.get_by_text(f"steps 0 -> {UI_MAX_STEPS}", exact=True)).to_be_visible()
            sync_api.expect(report.get_by_text("the final checkpoint's evaluation")).to_be_visible()
            sync_api.expect(report.locator("table").filter(has_text="validation loss during training")).to_have_count(1)
            # the goodput and cost ledger's table: where the run's time went
            sync_api.expect(report.locator("table").filter(has_text="productive steps")).to_have_count(1)
            curve = report.locator(f"img[alt='loss curve of {run}']")
            curve.wait_for()
            page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=curve.element_handle())
            src, width, height = curve.evaluate("img => [img.src, img.naturalWidth, img.naturalHeight]")
            png = (store / "runs" / run / "loss-curve.png").read_bytes()
            assert src == "data:image/png;base64," + base64.b64encode(png).decode()
            assert (width, height) == browser.png_size(png)
            box = curve.bounding_box()
            assert box and box["width"] > 100 and box["height"] > 50, box
            shot(page, "report", full_page=True)
            curve.scroll_into_view_if_needed()
            shot(page, "loss-curve", element=curve)

            # the checkpoint table: the final checkpoint, retained, with its loss
            page.goto(f"{base}/runs/flow-run/{run_id}")
            browser.dismiss_toasts(page)
            page.locator("li.p-tab#artifacts").click()
            page.locator(".artifact-card__title").filter(has_text=table_key).click()
            page.wait_for_url(re.compile("/artifacts/artifact/"))
            row = page.locator("tr").filter(has_text=f"step-{UI_MAX_STEPS:08d}")
            sync_api.expect(row).to_have_count(1)
            sync_api.expect(row).to_contain_text("yes")
            shot(page, "checkpoints", full_page=True)
        except BaseException:
            try:
                print(f"failed at {page.url}")
                shot(page, "failure", full_page=True)
            except Exception:  # the page or browser is gone: nothing to show
                pass
            print("--- worker log:\n" + open(worker_log).read()[-4000:])
            raise
        finally:
            chromium.close()
            print("screenshots:\n" + "\n".join(taken))


@pytest.mark.e2e
@pytest.mark.xdist_group("deployments-server")
def test_serve_runs_the_deployments_from_one_process_without_a_worker(prefect_api, deployed, tmp_path):
    """`stoker serve` after `stoker deploy` on the same server: it takes the four deployments
    over from the work pool (new ids; served by a runner in this one process: no work pool, no
    worker needed), points the one evaluate-checkpoint automation at the served
    evaluate-checkpoint, and a run of the ad-hoc one with tiny parameters completes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = {**prefect_api, "STOKER_ROOT": str(tmp_path / "store"), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    # the module's deploy: its pooled deployments are there until serve has replaced them
    with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            before = {d.id for d in client.read_deployments()}
            assert len(before) == 5 and all(d.work_pool_name for d in client.read_deployments())
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        served = start_process([sys.executable, "-m", "stoker.cli", "serve"], env, out)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                deployments = wait_for(
                    "the served deployments",
                    lambda: (lambda ds: ds if len(ds) == 5 and not {d.id for d in ds} & before else None)(
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
                    "soup",
                }
                assert all(d.work_pool_name is None for d in deployments)  # served, not pooled
                nightly = next(d for d in deployments if d.name == "continued-pretraining")
                assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
                # the one automation now runs the served evaluate-checkpoint
                evaluate = next(d for d in deployments if d.name == "evaluate-checkpoint")
                automations = wait_for(
                    "the automation on the served evaluate-checkpoint",
                    lambda: [
                        a
                        for a in client.read_automations_by_name(EVALUATE_AUTOMATION)
                        if a.actions[0].deployment_id == evaluate.id
                    ],
                    60,
                    [log],
                )
                assert len(client.read_automations_by_name(EVALUATE_AUTOMATION)) == len(automations) == 1
            params = tiny_dict(  # one rank: serving is the subject, not the gang
                "file://" + str(tmp_path / "store"),
                run_name="served",
                train={"max_steps": 4},
                launch={"nproc_per_node": 1},
            )
            flow_run = run_deployment("train-pipeline/train-adhoc", parameters={"config": params}, timeout=0)
            with get_client(sync_client=True) as client:
                done = wait_for_flow_run(client, flow_run.id, "the served run to finish", [log])
            assert done.state.type == StateType.COMPLETED, done.state.message + log.read_text()[-3000:]
            assert done.name == "served"
        assert "served from this process now" in log.read_text()
    finally:
        stop_process(served)
