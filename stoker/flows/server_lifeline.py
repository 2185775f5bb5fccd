"""Prefect's embedded ("temporary") server never outlives the process that started it.

Prefect starts it as a child process (``SubprocessASGIServer``: ``python -m uvicorn ...``) and
stops it only from an ``atexit`` hook, which a SIGKILL, or a SIGTERM that no handler turns into
an exception, never runs: the server then stayed up for as long as anyone watched. Here that
command runs under ``python -m stoker.process.lifeline --quiet <this process's token> uvicorn ...``, which ends
the server within a second of its starter's death, however it died.

Installed from ``stoker/flows/__init__.py``, before Prefect is imported; the patch is made when
Prefect first imports its server module (that import costs seconds, so it is not forced).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import subprocess
import sys
import threading

SERVER_MODULE = "prefect.server.api.server"
_LOCK = threading.Lock()


def _guarded_popen(args, *rest, env=None, **kwargs):
    """subprocess.Popen, with Prefect's ``python -m uvicorn`` wrapped in a lifeline."""
    from stoker.process import lifeline

    args = list(args)
    if args[1:3] == ["-m", "uvicorn"]:
        # quiet: the server ends with its starter every time (a Ctrl-C too), which is no news
        args = [args[0], "-m", "stoker.process.lifeline", "--quiet", lifeline.token(), *args[2:]]
    return subprocess.Popen(args, *rest, env=env, **kwargs)


class _SubprocessWithLifeline:
    """What the server module sees as ``subprocess`` while it starts the server."""

    Popen = staticmethod(_guarded_popen)

    def __getattr__(self, name):
        return getattr(subprocess, name)


def patch(module) -> None:
    """Wrap ``SubprocessASGIServer._run_uvicorn_command`` of Prefect's server module."""
    cls = getattr(module, "SubprocessASGIServer", None)
    original = getattr(cls, "_run_uvicorn_command", None)
    if original is None or getattr(original, "_stoker_lifeline", False):
        return  # another Prefect, or patched already

    def _run_uvicorn_command(self):
        with _LOCK:
            module.subprocess = _SubprocessWithLifeline()
            try:
                return original(self)
            finally:
                module.subprocess = subprocess

    _run_uvicorn_command._stoker_lifeline = True
    cls._run_uvicorn_command = _run_uvicorn_command


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds Prefect's server module the usual way, and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != SERVER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if SERVER_MODULE in sys.modules:
        patch(sys.modules[SERVER_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
