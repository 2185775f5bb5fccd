"""Export a committed checkpoint as a Hugging Face folder, in a process of its own
(stoker/training/export.py, started by launch.child: the orchestrator's rooms never import
torch). ``stoker export`` calls ``export_checkpoint``; a deployment can wrap it in a task the
same way."""

from __future__ import annotations

import json
import os

from stoker.contracts import events
from stoker.failures import ExportError
from stoker.launch.child import Child, outcome
from stoker.launch.env import STORAGE_OPTIONS_ENV, child_env
from stoker.storage.runs import export_source

EXPORT_TIMEOUT_SECONDS = 1800


def export_checkpoint(
    checkpoint_uri: str, folder: str, storage_options: dict | None = None, timeout: float = EXPORT_TIMEOUT_SECONDS
) -> events.Exported:
    """Write the checkpoint at `checkpoint_uri` into `folder` (new or empty) as
    the weights as safetensors + ``config.json`` (the model family's transformers class) and the run's tokenizer.

    Checked here first, without torch and without reading a tensor, so a mistake is one line
    at once: the URI's form, the run folder, the commit manifest and listed files, the
    checkpoint's identity, the output folder. Then ``python -m stoker.training.export`` reads the
    checkpoint the safe way (full sha256 check, tensors only) and writes the folder.
    ExportError (a StokerError) for anything that stops it."""
    folder = os.path.abspath(folder)
    named = export_source(checkpoint_uri, folder, storage_options)
    env = child_env(named.config)
    env[STORAGE_OPTIONS_ENV] = json.dumps(storage_options or {})
    got = outcome(Child("stoker.training.export", [checkpoint_uri, folder], env).run(timeout), events.Exported, timeout)
    if got.result is not None:
        return got.result
    raise ExportError(f"export of {checkpoint_uri} failed (exit {got.ended.returncode}): {got.why}")
