"""`stoker run` / `python -m stoker.cli run`: the whole pipeline on embedded defaults.

Sets the Prefect environment for an embedded server first (before Prefect is imported),
runs train_pipeline, then prints where everything went and how to open it. The parser and the
exit codes are here; the rest by job: `arguments` (the config from the command line and the
preflight), `supervisor` (the re-exec that owns the process group), `commands`, `render`.
"""

from __future__ import annotations

import argparse
import os
import sys

import stoker.flows  # noqa: F401  (Prefect's quiet offline settings, before Prefect is imported)
from stoker.cli.arguments import _preflight, check_api_reachable, checked_config, config_from_args  # noqa: F401
from stoker.cli.commands import _command
from stoker.cli.render import project_error_line
from stoker.cli.supervisor import _CHILD_ENV, INTERRUPTED, _supervise


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
    run.add_argument(
        "--branch-from",
        metavar="CHECKPOINT_URI",
        default=None,
        help="start a new run (a branch) from another run's committed checkpoint, under this config's "
        "schedule, data and evaluation; same as --set train.branch_from=URI",
    )
    val = sub.add_parser(
        "validate",
        help="every problem of a config on this host (the model, local files, GPUs, torch, extras, "
        "the store, the credentials block, MLflow) at once, without starting anything",
    )
    val.add_argument("--recipe", default="tiny-cpu", help="recipe name under stoker/recipes or a YAML/JSON file")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pl = sub.add_parser(
        "plan",
        help="the run's memory per device (weights, gradients, optimizer, activations, reserve) "
        "for each parallelism, its tokens, FLOPs, step and wall time and cost, before it spends anything",
    )
    pl.add_argument("--recipe", default="tiny-cpu", help="recipe name under stoker/recipes or a YAML/JSON file")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--accelerator", default=None, help="the GPU model, e.g. H100 (default: launch.accelerator)")
    pl.add_argument("--memory-gib", type=float, default=None, help="one device's memory in GiB (default: the model's)")
    pl.add_argument(
        "--mfu", type=float, default=None, help="the model FLOPs utilization the time assumes (default 0.4)"
    )
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
