"""The commands that read a store or run in this process: runs, checkpoints, verify, config,
validate, export, harness, deploy, serve (and, in the supervised child, run and evaluate)."""

from __future__ import annotations

import sys

from stoker.cli.arguments import _api_url, _sets, checked_config, config_from_args
from stoker.cli.render import _table, print_summary


def _root(given: str | None) -> str:
    from stoker.core.config import default_root

    return given or default_root()


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
    from stoker.observe import inspect

    if args.command == "runs" and args.ledger:
        return _print_ledger(inspect, _root(args.root), args.ledger)
    if args.command == "runs":
        rows = inspect.list_runs(_root(args.root))
        rows = [{**r, "run": r.get("tree", r["run"])} for r in rows]  # a branch under its parent
        columns = ["run", "newest_valid_step", "max_steps", "checkpoints", "ended", "goodput", "cost", "model"]
        optional = ("branch_of", "base", "data", "since_base")
        print(
            _table(rows, columns + [c for c in optional if any(r.get(c) for r in rows)])
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


def _plan(args) -> int:
    """`stoker plan`: the plan of the config on its devices, the alternatives beside it, and
    the refusal (exit 2) when it cannot fit."""
    from stoker.core import plan as plans
    from stoker.core.failures import ConfigError
    from stoker.preflight import shaped

    sets = list(args.set)
    if args.accelerator:
        sets.append(f"launch.accelerator={args.accelerator}")
    if args.memory_gib:
        sets.append(f"launch.device_memory_gib={args.memory_gib}")
    config = config_from_args(args.recipe, sets)
    if getattr(config.model, "init_from", None) and config.model.unresolved():
        try:
            config = shaped(config)
        except ConfigError as err:
            raise ConfigError(
                [
                    f"{p} (the plan needs the model's shape: give the base, or its architecture fields)"
                    for p in err.problems
                ]
            ) from None
    try:
        hardware = plans.hardware_of(config)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    mfu = args.mfu or plans.DEFAULT_MFU
    every = plans.plans_by_parallelism(config, hardware, mfu=mfu)
    where = hardware.name if hardware else "no device given (launch.accelerator, --accelerator): no fit checked"
    print(f"plan of run {config.resolved_run_name()} ({config.model.describe()}) on {where}")
    for p in every:
        print(("the run's" if p is every[0] else "instead") + f": {p.parallelism}")
        print(p.table())
    problem = plans.fit_problem(config, hardware)
    if problem:
        raise ConfigError([problem])
    return 0


def _command(args) -> int:
    if args.command in ("runs", "checkpoints", "verify", "config"):
        return _inspect(args)
    if args.command == "validate":
        return _validate(args)
    if args.command == "plan":
        return _plan(args)
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
