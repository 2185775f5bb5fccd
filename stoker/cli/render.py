"""What the command prints: tables, the end-of-run summary, a project error as one line."""

from __future__ import annotations


def project_error_line(err: BaseException) -> str | None:
    """The line (a ConfigError's: lines) of a project error that reached the caller as
    Prefect's FailedRun: a flow run that a project error ended (flows.fails_in_one_line:
    Failed, message ``failures.error_line``) whose engine holds the server's copy of that
    state, which has no data. That happens when the final state's proposal was sent twice (a
    slow server: the client tried again, and Prefect answers a repeated transition with the
    state it already has); calling the flow then raises FailedRun(message) instead of the error
    itself. Also a project error that Prefect's own error (raised while it reported that end)
    carries as its cause or context."""
    from prefect.exceptions import FailedRun

    from stoker.failures import ERROR_LINE_PREFIX, StokerError, error_line

    text = str(err)
    if isinstance(err, FailedRun) and text.startswith(ERROR_LINE_PREFIX):
        return text
    # Prefect's own error while it reported a project error's end (a server that answered
    # 'database is locked' to the final state): the project error is still the reason
    seen, cause = set(), _underneath(err)
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, StokerError):
            return error_line(cause)
        seen.add(id(cause))
        cause = _underneath(cause)
    return None


def _underneath(err: BaseException) -> BaseException | None:
    """The exception an error was raised from, or during (unless `raise ... from None`)."""
    if err.__cause__ is not None:
        return err.__cause__
    return None if err.__suppress_context__ else err.__context__


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


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
