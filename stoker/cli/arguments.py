"""From the command line to a checked config: `--recipe` and `--set KEY=VALUE` parsed into a
RunConfig, the preflight before any process or server starts, the Prefect API reachable."""

from __future__ import annotations

import os


def check_api_reachable(timeout: float = 5.0) -> None:
    """StokerError in one line when PREFECT_API_URL names a server that does not answer (no
    URL: stoker starts an embedded server). Any HTTP answer counts as there: only a refused
    connection or a time-out is reported."""
    import httpx

    from stoker.failures import StokerError

    url = _api_url()
    if not url:
        return
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as err:
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise StokerError(
            f"PREFECT_API_URL={url}: nothing answers there ({why}); start that Prefect "
            "server (prefect server start), or unset PREFECT_API_URL to run on "
            "stoker's embedded server"
        ) from None


def _api_url() -> str | None:
    """The Prefect server this command was given (None: stoker starts an embedded one)."""
    from prefect.settings import PREFECT_API_URL

    # the environment first: a settings context entered earlier in this process (a notebook's,
    # a test harness's) would otherwise hide the URL this command was given
    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()


def _preflight(args) -> None:
    if args.command == "evaluate":
        from stoker.tasks.evaluation import check_checkpoint_uri

        check_checkpoint_uri(args.checkpoint_uri)
        return
    if args.command == "soup":  # every check of the soup, before any server or process starts
        soup_plan(args)
        return
    from stoker.failures import ConfigError, is_transient

    try:
        checked_config(args.recipe, _sets(args))
    except ConfigError:
        raise
    except Exception as err:
        if not is_transient(err):
            raise


def checked_config(recipe: str, sets: list[str]):
    """The config of `--recipe R --set K=V ...`, checked on this host before anything starts:
    one ConfigError with every problem of the one preflight (``stoker.preflight``). A
    credentials block is loaded only from a Prefect server that is up (PREFECT_API_URL);
    without one the flow's first task loads it, and probes the store with it."""
    from stoker import preflight
    from stoker.config import build_config

    config = build_config(recipe, **_overrides(sets))
    load = None
    if config.storage.credentials_block and _api_url():
        from stoker.orchestration.credentials import use_store_credentials as load

        check_api_reachable()
    return preflight.check(config, load_credentials=load)


def _sets(args) -> list[str]:
    """`run`'s --set items, with --takeover and --branch-from as the fields they stand for."""
    branch = getattr(args, "branch_from", None)
    return [
        *args.set,
        *(["launch.takeover=true"] if getattr(args, "takeover", False) else []),
        *([f"train.branch_from={branch}"] if branch else []),
    ]


def config_from_args(recipe: str, sets: list[str]):
    """The checked config of `--recipe R --set K=V ...`; ConfigError for anything wrong."""
    from stoker.config import load_config

    return load_config(recipe, **_overrides(sets))


def _overrides(sets: list[str]) -> dict:
    """`--set KEY=VALUE` items as dotted keys, each value read as YAML."""
    import yaml

    from stoker.failures import ConfigError

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. train.max_steps=100"])
        try:
            overrides[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            why = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(
                [f"--set {item!r}: the value is not valid YAML ({why}); quote it, e.g. --set run_name='my-run'"]
            ) from None
    return overrides


def soup_weights(text: str | None) -> list[float] | None:
    """--weights w1,w2,...: floats, or one ConfigError line."""
    from stoker.failures import ConfigError

    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ConfigError([f"--weights: {text!r} is not a comma-separated list of numbers, e.g. 0.5,0.5"]) from None


def soup_plan(args):
    """`stoker soup`'s checks (storage.soups.resolve_soup), torch-free, before anything starts."""
    from stoker.launch.soup import check_soup

    return check_soup(
        args.checkpoints,
        soup_weights(args.weights),
        args.run_name,
        root=args.root,
        last=args.last,
        steps=args.steps,
        across_decay=args.across_decay,
    )
