"""`stoker deploy` and `stoker serve`: stoker's deployments, as prefect.yaml defines them.

deploy: one idempotent command against the Prefect server at $PREFECT_API_URL: the `process`
work pool, the global concurrency limit that a launch holds while its ranks run (one slot:
two runs never take the same accelerators), then `prefect deploy --all` from the project
root (prefect.yaml is the one definition of the deployments), and the automation that runs the
evaluate-checkpoint deployment on each ``stoker.checkpoint.committed`` event that its run does
not evaluate itself (orchestration.prefect_events). Run it again at will: each is found by its name.

serve: the same deployments served from this process by a Prefect runner, with their
schedules: a laptop needs no worker and no work pool. The evaluate-checkpoint automation is
pointed at the served deployment.
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from stoker.failures import ConfigError
from stoker.orchestration.prefect_events import ensure_evaluate_automation

# prefect.yaml sits beside the stoker package in a checkout, and its entrypoints
# (stoker/flows/...) are paths from that folder, which Prefect records as the runs' working folder
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFECT_YAML = os.path.join(SOURCE_ROOT, "prefect.yaml")
WORK_POOL = "stoker-process"
ACCELERATOR_LIMIT = "stoker-accelerators"  # launch.concurrency_limit's default


def deployment_specs() -> list[dict]:
    if not os.path.exists(PREFECT_YAML):
        raise ConfigError(
            [
                f"prefect.yaml: not found at {PREFECT_YAML}; deploy and serve run from a "
                "checkout of stoker (pip install -e <checkout>), where prefect.yaml "
                "defines the deployments."
            ]
        )
    with open(PREFECT_YAML) as f:
        return yaml.safe_load(f)["deployments"]


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            [
                "PREFECT_API_URL: not set, so there is no Prefect server to deploy to; "
                "start one (prefect server start) and export "
                "PREFECT_API_URL=http://127.0.0.1:4200/api"
            ]
        )
    return url


def ensure_work_pool_and_limit(slots: int = 1) -> list[str]:
    """Create the work pool and the accelerator limit where missing; what was done, in words."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(WORK_POOL)
            done.append(f"work pool {WORK_POOL!r}: already there")
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process"))
            done.append(f"work pool {WORK_POOL!r} (process): created")
        try:
            limit = client.read_global_concurrency_limit_by_name(ACCELERATOR_LIMIT)
            done.append(f"concurrency limit {ACCELERATOR_LIMIT!r}: already there ({limit.limit} slot(s))")
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=ACCELERATOR_LIMIT, limit=slots))
            done.append(f"concurrency limit {ACCELERATOR_LIMIT!r}: created with {slots} slot(s)")
    return done


def deploy() -> list[str]:
    """Pool, limit and every deployment of prefect.yaml; returns the lines to print."""
    url = _api_url()
    done = ensure_work_pool_and_limit()
    out = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"],
        cwd=SOURCE_ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
    )
    if out.returncode:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"prefect deploy --all failed (exit {out.returncode}):\n{tail}")
    names = [f"{_flow_name(d['entrypoint'])}/{d['name']}" for d in deployment_specs()]
    done += [f"deployment {n}: created or updated" for n in names]
    done.append(ensure_evaluate_automation())  # evaluation as a service, on each committed checkpoint
    done.append(f"start a worker: prefect worker start --pool {WORK_POOL}   (UI: {url.removesuffix('/api')})")
    return done


def _flow(entrypoint: str):
    """The flow object of 'stoker/flows/x.py:name', imported as the module flows.x (so a runner
    records the module's entrypoint, as prefect deploy does)."""
    import importlib

    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def _flow_name(entrypoint: str) -> str:
    return _flow(entrypoint).name


def runner_deployments() -> list:
    """prefect.yaml's deployments as runner deployments (for serve)."""
    out = []
    for spec in deployment_specs():
        flow = _flow(spec["entrypoint"])
        schedules = [s["cron"] for s in spec.get("schedules", []) if s.get("active", True) and "cron" in s]
        out.append(
            flow.to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                parameters=spec.get("parameters") or {},
                cron=schedules[0] if schedules else None,
            )
        )
    return out


def serve() -> None:
    """Serve every deployment from this process until interrupted."""
    from prefect import serve as prefect_serve

    _api_url()
    ensure_work_pool_and_limit()  # the limit (the pool is unused by served runs)
    for line in take_over_pooled_deployments():
        print(line)
    deployments = runner_deployments()
    for deployment in deployments:  # made now (serve updates them in place), for the automation
        deployment.apply()
    print(ensure_evaluate_automation())  # now on the served evaluate-checkpoint deployment
    prefect_serve(*deployments)


def take_over_pooled_deployments() -> list[str]:
    """Delete the deployments of prefect.yaml that `stoker deploy` put on a work pool. Served
    again under the same name, such a deployment would keep its work pool (Prefect's update
    leaves it) and no storage path: every run crashed with FileNotFoundError '<checkout>/None'.
    `stoker deploy` gives them back to the workers. Returns what was done, in words."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        for spec in deployment_specs():
            name = f"{_flow_name(spec['entrypoint'])}/{spec['name']}"
            try:
                found = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if found.work_pool_name:
                client.delete_deployment(found.id)
                done.append(
                    f"deployment {name}: was on work pool {found.work_pool_name!r} (stoker "
                    "deploy); served from this process now (stoker deploy gives it back)"
                )
    return done
