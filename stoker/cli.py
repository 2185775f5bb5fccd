"""`stoker run` / `python -m stoker.cli run`: the whole pipeline on embedded defaults.

Sets the Prefect environment for an embedded server first (before Prefect is imported),
runs train_pipeline, then prints where everything went and how to open it.
"""

from __future__ import annotations

import argparse
import os
import sys

import stoker.flows  # noqa: F401  (Prefect's quiet offline settings, before Prefect is imported)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the training pipeline")
    run.add_argument("--recipe", default="tiny-cpu", help="recipe name under stoker/recipes or a YAML/JSON file")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set train.max_steps=100",
    )
    run.add_argument(
        "--takeover",
        action="store_true",
        help="take the run over from another launch that holds its lease (it stops "
        "at its next heartbeat); same as --set launch.takeover=true",
    )
    val = sub.add_parser(
        "validate",
        help="every problem of a config on this host (the model, local files, GPUs, torch, extras, "
        "the store, the credentials block, MLflow) at once, without starting anything",
    )
    val.add_argument("--recipe", default="tiny-cpu", help="recipe name under stoker/recipes or a YAML/JSON file")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ev = sub.add_parser("evaluate", help="evaluate one checkpoint URI")
    ev.add_argument("checkpoint_uri")
    ex = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face folder (safetensors, config.json, the run's tokenizer) for AutoModelForCausalLM",
    )
    ex.add_argument("checkpoint_uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN")
    ex.add_argument("folder", help="a new or empty local folder")
    hv = sub.add_parser(
        "harness",
        help="lm-evaluation-harness tasks (the 'harness' extra) on an exported checkpoint: "
        "local-file tasks (stoker_mc: the vendored multiple-choice set), nothing downloaded",
    )
    hv.add_argument(
        "--checkpoint",
        default="latest",
        help="a checkpoint URI ({root}/runs/{run}/checkpoints/step-NNNNNNNN), an exported folder, or "
        "'latest': the newest valid checkpoint of the run of --recipe/--set",
    )
    hv.add_argument("--tasks", default=None, help="task names, comma-separated (default: eval.harness_tasks)")
    hv.add_argument(
        "--include",
        action="append",
        default=None,
        help="a folder of lm-eval task YAML files (default: eval.harness_include)",
    )
    hv.add_argument(
        "--limit", type=int, default=None, help="the first N items of each task (default: eval.harness_limit)"
    )
    hv.add_argument("--out", default=None, help="write the metrics as JSON here")
    hv.add_argument(
        "--samples", action="store_true", help="also write each item's log-likelihoods and verdicts to --out"
    )
    hv.add_argument(
        "--recipe", default="tiny-cpu", help="the run's recipe (its eval.harness_* and, for 'latest', its run)"
    )
    hv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    runs = sub.add_parser(
        "runs",
        help="list the runs in the store, with their newest valid checkpoint, goodput (productive step "
        "time / wall-clock, over every flow run) and cost (cost.per_accelerator_hour)",
    )
    runs.add_argument("--root", default=None, help="store root URL (default: storage.root's default)")
    runs.add_argument(
        "--ledger", metavar="RUN", default=None, help="where RUN's wall-clock and cost went, cause by cause"
    )
    cks = sub.add_parser("checkpoints", help="list a run's checkpoints, each with its validity")
    cks.add_argument("run")
    cks.add_argument("--root", default=None, help="store root URL (default: storage.root's default)")
    ver = sub.add_parser("verify", help="check every byte (sha256) of a checkpoint or shard set")
    ver.add_argument("uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN or {root}/shards/{key}")
    cfg = sub.add_parser("config", help="show the config: every key with its type, default and description")
    cfg.add_argument("--list", action="store_true", help="every key, type, default and description")
    cfg.add_argument("--recipe", default=None, help="show this recipe's values (with --set)")
    cfg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sub.add_parser(
        "deploy",
        help="create the work pool, the accelerator concurrency limit and "
        "the deployments of prefect.yaml on $PREFECT_API_URL (idempotent)",
    )
    sub.add_parser(
        "serve", help="serve the deployments of prefect.yaml from this process (schedules included; no worker needed)"
    )
    args = parser.parse_args(argv)

    from stoker.core.failures import StokerError, error_line

    try:
        if args.command in ("run", "evaluate", "deploy", "serve") and not os.environ.get(_CHILD_ENV):
            check_api_reachable()  # a server named but not there: one line, before any compute
        if args.command in ("run", "evaluate") and not os.environ.get(_CHILD_ENV):
            _preflight(args)  # config mistakes: one line before any process or server starts
            return _supervise(argv if argv is not None else sys.argv[1:])
        return _command(args)
    except StokerError as err:  # the user's mistake or the run's failure: one line, not a traceback
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the launcher has stopped the ranks on its way out
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except BaseException as err:  # Prefect's TerminationSignal (SIGTERM from the supervisor)
        if type(err).__name__ == "TerminationSignal":
            return 130  # the supervisor says the one line
        line = project_error_line(err)
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        raise


def project_error_line(err: BaseException) -> str | None:
    """The line (a ConfigError's: lines) of a project error that reached the caller as
    Prefect's FailedRun: a flow run that a project error ended (flows.fails_in_one_line:
    Failed, message ``core.failures.error_line``) whose engine holds the server's copy of that
    state, which has no data. That happens when the final state's proposal was sent twice (a
    slow server: the client tried again, and Prefect answers a repeated transition with the
    state it already has); calling the flow then raises FailedRun(message) instead of the error
    itself."""
    from prefect.exceptions import FailedRun

    from stoker.core.failures import ERROR_LINE_PREFIX

    text = str(err)
    return text if isinstance(err, FailedRun) and text.startswith(ERROR_LINE_PREFIX) else None


INTERRUPTED = (
    "stoker: interrupted; the ranks were stopped (a checkpoint was written if it "
    "fitted) and the attempt recorded; run the same command again to resume from "
    "the newest valid checkpoint"
)
_CHILD_ENV = "STOKER_CLI_CHILD"
STOP_SECONDS = 28  # the child's grace after SIGTERM: the launcher needs 20 s + 5 s


def check_api_reachable(timeout: float = 5.0) -> None:
    """StokerError in one line when PREFECT_API_URL names a server that does not answer (no
    URL: stoker starts an embedded server). Any HTTP answer counts as there: only a refused
    connection or a time-out is reported."""
    import httpx

    from stoker.core.failures import StokerError

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
        from stoker.tasks.evaluate import check_checkpoint_uri

        check_checkpoint_uri(args.checkpoint_uri)
        return
    from stoker.core.failures import ConfigError, is_transient

    try:
        checked_config(args.recipe, _sets(args))
    except ConfigError:
        raise
    except Exception as err:
        if not is_transient(err):
            raise
        # the store or the tracking server does not answer for now: the flow's first task
        # checks them again, and reports it there


def checked_config(recipe: str, sets: list[str]):
    """The config of `--recipe R --set K=V ...`, checked on this host before anything starts:
    one ConfigError with every problem of the one preflight (``stoker.preflight``). A
    credentials block is loaded only from a Prefect server that is up (PREFECT_API_URL);
    without one the flow's first task loads it, and probes the store with it."""
    from stoker import preflight
    from stoker.core.config import build_config

    config = build_config(recipe, **_overrides(sets))
    load = None
    if config.storage.credentials_block and _api_url():
        from stoker.orchestration.credentials import use_store_credentials as load

        check_api_reachable()
    return preflight.check(config, load_credentials=load)


def _end_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left of it after `grace` seconds."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _supervise(argv: list[str]) -> int:
    """Run the command in a child process in its own session, and stop it the way a cancel
    does. Ctrl-C in a terminal signals the whole foreground process group, which would kill
    Prefect's embedded server (a child of the flow's process) at once: the flow run would stay
    Running forever and nothing could record the interrupted attempt. Here only this process
    gets the signal; it sends SIGTERM to the child, where Prefect turns it into a crash of the
    flow run (reported to the server, still up), the launcher stops the ranks (a checkpoint
    if it fits) and records the attempt; then it prints one line."""
    import signal
    import subprocess

    from stoker.core.lifeline import start_child

    me = os.getpid()
    # SIGKILLed (the OOM killer), this process cannot stop the child: the kernel sends it the
    # SIGTERM of a cancel instead (forked from the main thread, which lives as long as we do)
    child = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", *argv],
        env={**os.environ, _CHILD_ENV: "1"},
        start_new_session=True,
        preexec_fn=lambda: start_child(parent=me),
    )
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    import time

    try:
        deadline = None
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopping and deadline is None:
                    deadline = time.monotonic() + STOP_SECONDS
                if deadline is not None and time.monotonic() > deadline:  # past the grace
                    os.killpg(child.pid, signal.SIGKILL)
                    deadline = float("inf")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _end_group(child.pid)  # what the child left in its session: Prefect's embedded server
    if stopping:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    return code


def _sets(args) -> list[str]:
    """`run`'s --set items, with --takeover as the field it stands for."""
    return [*args.set, *(["launch.takeover=true"] if getattr(args, "takeover", False) else [])]


def config_from_args(recipe: str, sets: list[str]):
    """The checked config of `--recipe R --set K=V ...`; ConfigError for anything wrong."""
    from stoker.core.config import load_config

    return load_config(recipe, **_overrides(sets))


def _overrides(sets: list[str]) -> dict:
    """`--set KEY=VALUE` items as dotted keys, each value read as YAML."""
    import yaml

    from stoker.core.failures import ConfigError

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


def _root(given: str | None) -> str:
    from stoker.core.config import default_root

    return given or default_root()


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _inspect(args) -> int:
    """runs, checkpoints, verify, config: no flow run, no Prefect server."""
    if args.command == "config":
        from stoker.core.config import field_table

        if args.list or not args.recipe:
            for row in field_table():
                print(f"{row['key']}  [{row['type']}]  default: {row['default']!r}\n    {row['description']}")
            return 0
        import json

        print(json.dumps(config_from_args(args.recipe, args.set).model_dump(mode="json"), indent=2))
        return 0
    from stoker.tasks import inspect

    if args.command == "runs" and args.ledger:
        return _print_ledger(inspect, _root(args.root), args.ledger)
    if args.command == "runs":
        rows = inspect.list_runs(_root(args.root))
        columns = ["run", "newest_valid_step", "max_steps", "checkpoints", "ended", "goodput", "cost", "model"]
        print(
            _table(rows, columns + [c for c in ("base", "data") if any(r.get(c) for r in rows)])
            if rows
            else f"no runs under {_root(args.root)}"
        )
        deployments = inspect.deployment_rows(_root(args.root)) if rows else []
        if deployments:
            print("\nper deployment (its flow runs that reported):")
            print(_table(deployments, ["deployment", "runs", "flow_runs", "wall", "goodput", "cost"]))
        return 0
    if args.command == "checkpoints":
        rows = inspect.list_checkpoint_folders(_root(args.root), args.run)
        if not rows:
            print(f"run {args.run!r} has no checkpoint under {_root(args.root)}")
            return 0
        for row in rows:  # listings and sizes only: `verify` is the one that reads every byte
            row["state"] = "committed (not verified)" if row["valid"] else f"INVALID: {row['reason']}"
        print(_table(rows, ["step", "name", "size_mb", "state", "uri"]))
        print(
            "committed: commit manifest present, every listed file at its size; `stoker verify URI` checks every sha256"
        )
        return 0
    what, verdict = inspect.verify(args.uri)
    if verdict:
        files = (verdict.manifest or {}).get("files", {})
        print(f"{what} {args.uri}: intact ({len(files)} files, every sha256 matches)")
        return 0
    print(f"stoker: {what} {args.uri} is not intact: {verdict.reason}", file=sys.stderr)
    return 1


def _print_ledger(inspect, root: str, run: str) -> int:
    """`stoker runs --ledger RUN`: each flow run's line, then the run's causes."""
    lines, rows = inspect.run_ledger(root, run)
    if not lines:
        print(f"run {run!r} has no recorded launch under {root}")
        return 0
    print("\n".join(lines))
    print(_table(rows, ["cause", "seconds", "share", "cost"]))
    return 0


def _validate(args) -> int:
    """`stoker validate`: the checks `stoker run` makes before it starts, and nothing else."""
    from stoker.core.failures import ConfigError, StokerError, describe, is_transient

    try:
        config = checked_config(args.recipe, args.set)
    except ConfigError:
        raise
    except Exception as err:
        if not is_transient(err):
            raise
        raise StokerError(f"the checks could not finish: {describe(err)}; try again") from None
    print(f"run {config.resolved_run_name()}: no problem found on this host")
    if config.storage.credentials_block and not _api_url():
        print(
            f"storage.credentials_block {config.storage.credentials_block!r} was not loaded (no "
            "PREFECT_API_URL): the flow's first task loads it and probes the store with it"
        )
    return 0


def _command(args) -> int:
    if args.command in ("runs", "checkpoints", "verify", "config"):
        return _inspect(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "deploy":
        from stoker.flows.deploy import deploy

        for line in deploy():
            print(line)
        return 0
    if args.command == "serve":
        from stoker.flows.deploy import serve

        serve()
        return 0
    if args.command == "export":  # no flow run: one process that reads the store, writes a folder
        from stoker.launch.export import export_checkpoint

        done = export_checkpoint(args.checkpoint_uri, args.folder)
        print(
            f"exported step {done.step} ({done.num_params:,} parameters, vocabulary "
            f"{done.vocab_size}) of {done.checkpoint}\nto {done.folder}: {', '.join(done.files)}\n"
            f"load it with transformers.AutoModelForCausalLM.from_pretrained({done.folder!r})"
        )
        return 0
    if args.command == "harness":
        return _harness(args)
    if args.command == "evaluate":
        from stoker.flows.evaluate import evaluate_checkpoint_flow  # the URI was checked: _preflight
        from stoker.observe.report import evaluation_line

        result = evaluate_checkpoint_flow(args.checkpoint_uri)
        print(f"\n{evaluation_line(result)} at step {result.step} ({result.checkpoint_uri})")
        return 0
    config = config_from_args(args.recipe, _sets(args))  # host checks: _preflight (and the flow)
    from stoker.flows.pipeline import train_pipeline

    result = train_pipeline(config)
    print_summary(result)
    return 0


def _harness(args) -> int:
    """`stoker harness`: no flow run; one process exports the checkpoint and runs lm-eval."""
    from stoker.launch.harness import harness_line, latest_checkpoint_uri, run_harness

    config = config_from_args(args.recipe, args.set)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None else None
    source = latest_checkpoint_uri(config) if args.checkpoint == "latest" else args.checkpoint
    done = run_harness(
        source,
        config.eval.harness_tasks if tasks is None else tasks,
        config.eval.harness_include if args.include is None else args.include,
        config.eval.harness_limit if args.limit is None else args.limit,
        args.out,
        args.samples,
        config,
        fields=(
            "--tasks" if tasks is not None else "eval.harness_tasks",
            "--include" if args.include else "eval.harness_include",
        ),
    )
    at = f"step {done.step} of {done.checkpoint}" if done.checkpoint else source
    print(f"lm-evaluation-harness on {at} ({done.seconds:.0f}s):\n{harness_line(done)}")
    if done.out:
        print(f"metrics (JSON): {done.out}")
    return 0


def print_summary(result) -> None:
    print("\n" + "=" * 72)
    print(f"run {result.run_name}: step {result.resumed_from_step} -> {result.final_step}")
    if result.first_train_loss is not None:
        print(
            f"training loss: {result.first_train_loss:.4f} (first logged step) -> {result.last_train_loss:.4f} (last)"
        )
    for step, loss in result.val_losses:
        print(f"  validation loss at step {step:>6}: {loss:.4f}")
    if result.num_attempts > 1:
        print(f"attempts: {result.num_attempts}, steps lost to failures: {result.steps_lost}")
    if result.ledger is not None:
        from stoker.observe.inspect import ledger_line

        print(f"{ledger_line(result.ledger)} (`stoker runs --ledger {result.run_name}`: where it went)")
    elif result.goodput is not None:
        print(f"goodput (useful training time / total time): {result.goodput:.2f}")
    if result.last_val_loss is not None:
        print(f"final checkpoint validation loss: {result.last_val_loss:.4f}")
    print(f"shards ({'cache hit' if result.data_cache_hit else 'tokenized now'}): {result.shard_uri}")
    print(f"final checkpoint: {result.final_checkpoint_uri}")
    print(f"metrics (JSON lines): {result.metrics_uri}")
    print(f"run folder (config.json, tokenizer.json, checkpoints/): {result.run_uri}")
    print("open them:")
    print("  the flow runs, logs and artifacts:  prefect server start   (then http://127.0.0.1:4200)")
    print(f"  evaluate a checkpoint again:        python -m stoker.cli evaluate {result.final_checkpoint_uri}")
    print("  run again to resume (same config => same run name, continues from the newest valid checkpoint)")
    print("=" * 72)


if __name__ == "__main__":
    sys.exit(main())
