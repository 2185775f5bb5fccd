"""The Prefect UI in a real browser: Debian's Chromium driven by Playwright opens the UI of a
real `prefect server start`, starts a custom run of `train-pipeline/train-adhoc` from the
deployment's form with one field changed (train.max_steps), waits on the run page until the
run is Completed, and checks that the run's artifacts show the report with its loss curve
(the data-URI image decoded by the browser, the very PNG of the run folder) and the
checkpoint table. Screenshots of every step are kept under the test's tmp_path."""

import base64
import os
import re
import struct

import pytest

from stoker.core.config import RunConfig, load_config
from tests.conftest import start_worker, stoker_deploy, stop_process

# Debian's package (scripts/setup.sh test installs it); STOKER_TEST_CHROMIUM names another binary
CHROMIUM = os.environ.get("STOKER_TEST_CHROMIUM", "/usr/bin/chromium")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed (the [test] extra)")

# headless on a small CI machine; nothing reaches out of 127.0.0.1
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # no WebGL: the run page's timeline graph (a WebGL canvas, software-rendered by SwiftShader
    # without a GPU) redraws on every frame while a run is Running: ~0.5 CPU s per second there
    # (17 of 30 s measured), most of this test's CPU. Nothing here is about the graph: its area
    # stays empty, and the rest of the page is the same.
    "--disable-3d-apis",
]
MAX_STEPS = 24  # the one field the form changes (the recipe says 500); above warmup_steps (20), as it must be
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled")


def dismiss_toasts(page, appear_within_ms: int = 0) -> None:
    """Close the UI's toasts with their close buttons, as a user would: its "Oops. Something
    went wrong." (after a 503) stays until closed, over the cards a test clicks. With
    `appear_within_ms`, first wait that long for one to show."""
    closes = page.locator("#prefect-design-toast-app .p-toast__close-btn")
    if appear_within_ms:
        try:
            closes.first.wait_for(timeout=appear_within_ms)
        except sync_api.Error:
            return
    for _ in range(10):
        visible = [c for c in closes.all() if c.is_visible()]
        if not visible:
            return
        try:
            visible[-1].click(timeout=3_000)
        except sync_api.Error:  # gone by itself, or under the other toast layer
            pass


def _form_input(page, label: str):
    """The input of the schema form's property labelled `label` (its labels carry no `for`
    that names the input, so: the nearest property container of the label)."""
    return page.locator(
        f"xpath=//span[contains(@class,'schema-form-property__label')][normalize-space()='{label}']"
        "/ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]"
        "//input"
    )


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    return struct.unpack(">II", data[16:24])


@pytest.mark.e2e
def test_custom_run_from_the_ui_form_completes_and_its_page_shows_report_and_loss_curve(prefect_api, tmp_path):
    store = tmp_path / "store"
    env = {**prefect_api, "STOKER_ROOT": str(store), "STOKER_CACHE": str(tmp_path / "cache")}
    base = prefect_api["PREFECT_API_URL"].removesuffix("/api")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    recipe = load_config("tiny-cpu").model_dump(mode="json")
    expected = load_config("tiny-cpu", train__max_steps=MAX_STEPS)
    run = expected.resolved_run_name()

    stoker_deploy(env)
    worker_log = tmp_path / "worker.log"
    worker = start_worker(env, worker_log)
    taken: list[str] = []

    def shot(page, name, **kw):
        path = str(shots / f"{len(taken) + 1:02d}-{name}.png")
        (kw.pop("element", None) or page).screenshot(path=path, **kw)
        taken.append(path)

    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
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
                max_steps = _form_input(page, "Max Steps (Optional)")
                assert max_steps.count() == 1
                assert max_steps.input_value() == str(recipe["train"]["max_steps"])
                assert page.get_by_text("Optimizer steps to train in total (across resumes).").count() == 1
                max_steps.fill(str(MAX_STEPS))
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
                    dismiss_toasts(page, appear_within_ms=10_000)
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
                dismiss_toasts(page)  # an error toast (a 503 under load) stays and covers cards
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
                sync_api.expect(report.get_by_text(f"steps 0 -> {MAX_STEPS}", exact=True)).to_be_visible()
                sync_api.expect(report.get_by_text("the final checkpoint's evaluation")).to_be_visible()
                sync_api.expect(
                    report.locator("table").filter(has_text="validation loss during training")
                ).to_have_count(1)
                # the goodput and cost ledger's table: where the run's time went
                sync_api.expect(report.locator("table").filter(has_text="productive steps")).to_have_count(1)
                curve = report.locator(f"img[alt='loss curve of {run}']")
                curve.wait_for()
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=curve.element_handle())
                src, width, height = curve.evaluate("img => [img.src, img.naturalWidth, img.naturalHeight]")
                png = (store / "runs" / run / "loss-curve.png").read_bytes()
                assert src == "data:image/png;base64," + base64.b64encode(png).decode()
                assert (width, height) == _png_size(png)
                box = curve.bounding_box()
                assert box and box["width"] > 100 and box["height"] > 50, box
                shot(page, "report", full_page=True)
                curve.scroll_into_view_if_needed()
                shot(page, "loss-curve", element=curve)

                # the checkpoint table: the final checkpoint, retained, with its loss
                page.goto(f"{base}/runs/flow-run/{run_id}")
                dismiss_toasts(page)
                page.locator("li.p-tab#artifacts").click()
                page.locator(".artifact-card__title").filter(has_text=table_key).click()
                page.wait_for_url(re.compile("/artifacts/artifact/"))
                row = page.locator("tr").filter(has_text=f"step-{MAX_STEPS:08d}")
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
                browser.close()
                print("screenshots:\n" + "\n".join(taken))
    finally:
        stop_process(worker)
