"""`stoker run` / `python -m flows.cli run`: the whole pipeline on embedded defaults.

Sets the Prefect environment for an embedded server first (before Prefect is imported),
runs train_pipeline, then prints where everything went and how to open it.
"""

from __future__ import annotations

import argparse
import sys

import flows  # noqa: F401  (Prefect's quiet offline settings, before Prefect is imported)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the training pipeline")
    run.add_argument("--recipe", default="tiny-cpu",
                     help="recipe name under deployments/recipes or a YAML/JSON file")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field, e.g. --set train.max_steps=100")
    ev = sub.add_parser("evaluate", help="evaluate one checkpoint URI")
    ev.add_argument("checkpoint_uri")
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face GPT-2 folder "
                        "(model.safetensors, config.json, the run's tokenizer)")
    ex.add_argument("checkpoint_uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN")
    ex.add_argument("folder", help="a new or empty local folder")
    args = parser.parse_args(argv)

    from core.failures import StokerError

    try:
        return _command(args)
    except StokerError as err:  # the user's mistake or the run's failure: one line, not a traceback
        print(f"stoker: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the launcher has stopped the ranks on its way out
        print("stoker: interrupted; run the same command again to resume from the newest valid "
              "checkpoint", file=sys.stderr)
        return 130


def config_from_args(recipe: str, sets: list[str]):
    """The checked config of `--recipe R --set K=V ...`; ConfigError for anything wrong."""
    import yaml

    from core.config import load_config
    from core.failures import ConfigError

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. train.max_steps=100"])
        try:
            overrides[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            why = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError([f"--set {item!r}: the value is not valid YAML ({why}); "
                               "quote it, e.g. --set run_name='my-run'"]) from None
    return load_config(recipe, **overrides)


def _command(args) -> int:

    if args.command == "export":  # no flow run: one process that reads the store, writes a folder
        from tasks.export import export_checkpoint

        done = export_checkpoint(args.checkpoint_uri, args.folder)
        print(f"exported step {done.step} ({done.num_params:,} parameters, vocabulary "
              f"{done.vocab_size}) of {done.checkpoint}\nto {done.folder}: {', '.join(done.files)}\n"
              f"load it with transformers.GPT2LMHeadModel.from_pretrained({done.folder!r})")
        return 0
    if args.command == "evaluate":
        from tasks.evaluate import check_checkpoint_uri

        check_checkpoint_uri(args.checkpoint_uri)  # before a flow run starts
        from flows.evaluate import evaluate_checkpoint_flow

        result = evaluate_checkpoint_flow(args.checkpoint_uri)
        print(f"\nvalidation loss {result.val_loss:.4f}, perplexity {result.val_ppl:.1f} "
              f"at step {result.step} ({result.checkpoint_uri})")
        return 0
    config = config_from_args(args.recipe, args.set)

    from flows.pipeline import train_pipeline

    result = train_pipeline(config)
    print_summary(result)
    return 0


def print_summary(result) -> None:
    print("\n" + "=" * 72)
    print(f"run {result.run_name}: step {result.resumed_from_step} -> {result.final_step}")
    if result.first_train_loss is not None:
        print(f"training loss: {result.first_train_loss:.4f} (first logged step) -> "
              f"{result.last_train_loss:.4f} (last)")
    for step, loss in result.val_losses:
        print(f"  validation loss at step {step:>6}: {loss:.4f}")
    if result.num_attempts > 1:
        print(f"attempts: {result.num_attempts}, steps lost to failures: {result.steps_lost}")
    if result.goodput is not None:
        print(f"goodput (useful training time / total time): {result.goodput:.2f}")
    if result.last_val_loss is not None:
        print(f"final checkpoint validation loss: {result.last_val_loss:.4f}")
    print(f"shards ({'cache hit' if result.data_cache_hit else 'tokenized now'}): {result.shard_uri}")
    print(f"final checkpoint: {result.final_checkpoint_uri}")
    print(f"metrics (JSON lines): {result.metrics_uri}")
    print(f"run folder (config.json, tokenizer.json, checkpoints/): {result.run_uri}")
    print("open them:")
    print(f"  the flow runs, logs and artifacts:  prefect server start   (then http://127.0.0.1:4200)")
    print(f"  evaluate a checkpoint again:        python -m flows.cli evaluate {result.final_checkpoint_uri}")
    print("  run again to resume (same config => same run name, continues from the newest valid checkpoint)")
    print("=" * 72)


if __name__ == "__main__":
    sys.exit(main())
