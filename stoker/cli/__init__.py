"""`stoker run` / `python -m stoker.cli run`: the whole pipeline on embedded defaults.

Sets the Prefect environment for an embedded server first (before Prefect is imported),
runs train_pipeline, then prints where everything went and how to open it. The parser and the
exit codes are here; the rest by job: `commands` (the table of commands, each with its
arguments and its handler), `arguments` (the config from the command line and the preflight),
`supervisor` (the re-exec that owns the process group), `render`.
"""

from __future__ import annotations

import argparse
import os
import sys

import stoker.flows  # noqa: F401  (Prefect's quiet offline settings, before Prefect is imported)
from stoker.cli.arguments import _preflight, check_api_reachable, checked_config, config_from_args  # noqa: F401
from stoker.cli.commands import BY_NAME, add_commands
from stoker.cli.render import project_error_line
from stoker.cli.supervisor import _CHILD_ENV, INTERRUPTED, _supervise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker", description=__doc__)
    add_commands(parser)
    args = parser.parse_args(argv)
    command = BY_NAME[args.command]

    from stoker.failures import StokerError, error_line

    try:
        if command.needs_api and not os.environ.get(_CHILD_ENV):
            check_api_reachable()  # a server named but not there: one line, before any compute
        if command.supervised and not os.environ.get(_CHILD_ENV):
            _preflight(args)  # config mistakes: one line before any process or server starts
            return _supervise(argv if argv is not None else sys.argv[1:])
        return command.handler(args)
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
