"""The commands of `stoker`, as a table (``COMMANDS``): each owns its arguments and its handler;
``--recipe``/``--set`` are declared once (``Command.config``). The parser is made from the
table (``stoker.cli.main``); `run` and `evaluate` are supervised (``Command.supervised``: the
preflight, then the flow in a child of its own process group)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from stoker.cli.arguments import _api_url, _sets, checked_config, config_from_args
from stoker.cli.render import _table, print_summary


def _root(given: str | None) -> str:
    from stoker.config import default_root

    return given or default_root()


def _config(args) -> int:
    """`stoker config`: every key with its type, default and description, or a recipe's values."""
    from stoker.config import field_table

    if args.list or not args.recipe:
        for row in field_table():
            print(f"{row['key']}  [{row['type']}]  default: {row['default']!r}\n    {row['description']}")
        return 0
    import json

    print(json.dumps(config_from_args(args.recipe, args.set).model_dump(mode="json"), indent=2))
    return 0


def _runs(args) -> int:
    """`stoker runs`: the runs in the store (no flow run, no Prefect server)."""
    from stoker.observe import inspect

    if args.ledger:
        return _print_ledger(inspect, _root(args.root), args.ledger)
    rows = inspect.list_runs(_root(args.root))
    rows = [{**r, "run": r.get("tree", r["run"])} for r in rows]  # a branch under its parent
    columns = ["run", "newest_valid_step", "max_steps", "checkpoints", "ended", "goodput", "cost", "model"]
    optional = ("branch_of", "soup_of", "base", "data", "stages", "filtered", "removed", "since_base")
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


def _checkpoints(args) -> int:
    """`stoker checkpoints RUN`: listings and sizes only; `verify` is the one that reads every byte."""
    from stoker.observe import inspect

    rows = inspect.list_checkpoint_folders(_root(args.root), args.run)
    if not rows:
        print(f"run {args.run!r} has no checkpoint under {_root(args.root)}")
        return 0
    for row in rows:
        row["state"] = "committed (not verified)" if row["valid"] else f"INVALID: {row['reason']}"
    print(_table(rows, ["step", "name", "size_mb", "state", "uri"]))
    print("committed: commit manifest present, every listed file at its size; `stoker verify URI` checks every sha256")
    return 0


def _verify(args) -> int:
    """`stoker verify URI`: every sha256 of a checkpoint or shard set."""
    from stoker.observe import inspect

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
    from stoker.failures import ConfigError, StokerError, describe, is_transient

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
    from stoker.arithmetic import plan as plans
    from stoker.failures import ConfigError
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


def _deploy(args) -> int:
    from stoker.flows.deploy import deploy

    for line in deploy():
        print(line)
    return 0


def _serve(args) -> int:
    from stoker.flows.deploy import serve

    serve()
    return 0


def _export(args) -> int:
    """No flow run: one process that reads the store and writes a folder."""
    from stoker.launch.export import export_checkpoint

    done = export_checkpoint(args.checkpoint_uri, args.folder)
    print(
        f"exported step {done.step} ({done.num_params:,} parameters, vocabulary "
        f"{done.vocab_size}) of {done.checkpoint}\nto {done.folder}: {', '.join(done.files)}\n"
        f"load it with transformers.AutoModelForCausalLM.from_pretrained({done.folder!r})"
    )
    return 0


def _evaluate(args) -> int:
    from stoker.flows.evaluation_flow import evaluate_checkpoint_flow  # the URI was checked: the preflight
    from stoker.observe.report import evaluation_line

    result = evaluate_checkpoint_flow(args.checkpoint_uri)
    print(f"\n{evaluation_line(result)} at step {result.step} ({result.checkpoint_uri})")
    return 0


def _run(args) -> int:
    config = config_from_args(args.recipe, _sets(args))  # host checks: the preflight (and the flow)
    from stoker.flows.pipeline import train_pipeline

    result = train_pipeline(config)
    print_summary(result)
    return 0


def _soup(args) -> int:
    from stoker.cli.arguments import soup_weights
    from stoker.flows.soup import soup  # the inputs were checked: the preflight

    result = soup(
        args.checkpoints,
        soup_weights(args.weights),
        args.run_name,
        args.last,
        args.steps,
        args.across_decay,
        root=args.root,
    )
    said = "made" if result.computed else "made before (nothing recomputed)"
    print(f"\nsoup {result.run_name} {said}: {result.checkpoint_uri} (step {result.step})")
    if result.rows:
        columns = list(result.rows[0])
        print(
            _table(
                [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in result.rows], columns
            )
        )
    print(f"export it: stoker export {result.checkpoint_uri} ./{result.run_name}-hf")
    return 0


def _soup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoints", nargs="+", metavar="URI", help="committed checkpoint URIs, or one RUN with --last/--steps"
    )
    p.add_argument("--weights", default=None, help="w1,w2,...: one per checkpoint, summing to 1 (default: uniform)")
    p.add_argument("--run-name", default=None, help="the soup's run (default: soup-<its identity>)")
    p.add_argument("--last", type=int, default=None, metavar="K", help="a RUN's newest K committed checkpoints")
    p.add_argument("--steps", default=None, metavar="A..B", help="a RUN's committed checkpoints with steps in A..B")
    p.add_argument(
        "--across-decay", action="store_true", help="allow a RUN's window that spans a decay (refused otherwise)"
    )
    _root_argument(p)


def _harness(args) -> int:
    """`stoker harness`: no flow run; one process exports the checkpoint and runs lm-eval."""
    from stoker.launch.harness_child import harness_line, latest_checkpoint_uri, run_harness

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


# ---- the table -----------------------------------------------------------------------------
RECIPE_HELP = "recipe name under stoker/recipes or a YAML/JSON file"


@dataclass(frozen=True)
class Command:
    """One `stoker` command: its name, its help, its own arguments and its handler.
    ``config``: it takes --recipe/--set (the help of --recipe, or None); ``supervised``: the
    preflight, then the handler in a child of its own process group (`run`, `evaluate`);
    ``needs_api``: a PREFECT_API_URL named must answer first."""

    name: str
    help: str
    handler: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    config: str | None = None
    recipe_default: str | None = "tiny-cpu"
    supervised: bool = False
    needs_api: bool = False


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--takeover",
        action="store_true",
        help="take the run over from another launch that holds its lease (it stops "
        "at its next heartbeat); same as --set launch.takeover=true",
    )
    p.add_argument(
        "--branch-from",
        metavar="CHECKPOINT_URI",
        default=None,
        help="start a new run (a branch) from another run's committed checkpoint, under this config's "
        "schedule, data and evaluation; same as --set train.branch_from=URI",
    )


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accelerator", default=None, help="the GPU model, e.g. H100 (default: launch.accelerator)")
    p.add_argument("--memory-gib", type=float, default=None, help="one device's memory in GiB (default: the model's)")
    p.add_argument("--mfu", type=float, default=None, help="the model FLOPs utilization the time assumes (default 0.4)")


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN")
    p.add_argument("folder", help="a new or empty local folder")


def _harness_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default="latest",
        help="a checkpoint URI ({root}/runs/{run}/checkpoints/step-NNNNNNNN), an exported folder, or "
        "'latest': the newest valid checkpoint of the run of --recipe/--set",
    )
    p.add_argument("--tasks", default=None, help="task names, comma-separated (default: eval.harness_tasks)")
    p.add_argument(
        "--include",
        action="append",
        default=None,
        help="a folder of lm-eval task YAML files (default: eval.harness_include)",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="the first N items of each task (default: eval.harness_limit)"
    )
    p.add_argument("--out", default=None, help="write the metrics as JSON here")
    p.add_argument(
        "--samples", action="store_true", help="also write each item's log-likelihoods and verdicts to --out"
    )


def _root_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=None, help="store root URL (default: storage.root's default)")


def _runs_arguments(p: argparse.ArgumentParser) -> None:
    _root_argument(p)
    p.add_argument("--ledger", metavar="RUN", default=None, help="where RUN's wall-clock and cost went, cause by cause")


def _checkpoints_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run")
    _root_argument(p)


COMMANDS: tuple[Command, ...] = (
    Command("run", "run the training pipeline", _run, _run_arguments, RECIPE_HELP, supervised=True, needs_api=True),
    Command(
        "validate",
        "every problem of a config on this host (the model, local files, GPUs, torch, extras, "
        "the store, the credentials block, MLflow) at once, without starting anything",
        _validate,
        config=RECIPE_HELP,
    ),
    Command(
        "plan",
        "the run's memory per device (weights, gradients, optimizer, activations, reserve) "
        "for each parallelism, its tokens, FLOPs, step and wall time and cost, before it spends anything",
        _plan,
        _plan_arguments,
        RECIPE_HELP,
    ),
    Command(
        "evaluate",
        "evaluate one checkpoint URI",
        _evaluate,
        lambda p: p.add_argument("checkpoint_uri"),
        supervised=True,
        needs_api=True,
    ),
    Command(
        "soup",
        "average committed checkpoints of one model (runs, branches, or a RUN's own --last K) into a new "
        "run's first checkpoint; evaluate it beside each input and the base, per source",
        _soup,
        _soup_arguments,
        supervised=True,
        needs_api=True,
    ),
    Command(
        "export",
        "write a checkpoint as a Hugging Face folder (safetensors, config.json, the run's tokenizer) for "
        "AutoModelForCausalLM",
        _export,
        _export_arguments,
    ),
    Command(
        "harness",
        "lm-evaluation-harness tasks (the 'harness' extra) on an exported checkpoint: "
        "local-file tasks (stoker_mc: the vendored multiple-choice set), nothing downloaded",
        _harness,
        _harness_arguments,
        "the run's recipe (its eval.harness_* and, for 'latest', its run)",
    ),
    Command(
        "runs",
        "list the runs in the store, with their newest valid checkpoint, goodput (productive step "
        "time / wall-clock, over every flow run) and cost (cost.per_accelerator_hour)",
        _runs,
        _runs_arguments,
    ),
    Command("checkpoints", "list a run's checkpoints, each with its validity", _checkpoints, _checkpoints_arguments),
    Command(
        "verify",
        "check every byte (sha256) of a checkpoint or shard set",
        _verify,
        lambda p: p.add_argument("uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN or {root}/shards/{key}"),
    ),
    Command(
        "config",
        "show the config: every key with its type, default and description",
        _config,
        lambda p: p.add_argument("--list", action="store_true", help="every key, type, default and description"),
        "show this recipe's values (with --set)",
        recipe_default=None,
    ),
    Command(
        "deploy",
        "create the work pool, the accelerator concurrency limit and "
        "the deployments of prefect.yaml on $PREFECT_API_URL (idempotent)",
        _deploy,
        needs_api=True,
    ),
    Command(
        "serve",
        "serve the deployments of prefect.yaml from this process (schedules included; no worker needed)",
        _serve,
        needs_api=True,
    ),
)
BY_NAME = {c.name: c for c in COMMANDS}


def add_commands(parser: argparse.ArgumentParser) -> None:
    """The table as subcommands: each command's own arguments, then --recipe/--set where it
    takes a config (declared here, once)."""
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.arguments(p)
        if command.config:
            p.add_argument("--recipe", default=command.recipe_default, help=command.config)
            p.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="override a field, e.g. --set train.max_steps=100",
            )
