"""One failure taxonomy and one retry helper, used by ranks, sources, storage and the launcher.

``classify(exc)`` answers one question: can a retry help? ``transient`` for lost peers,
network and storage blips, 5xx/429, time-outs and signals; ``permanent`` for user mistakes
(config, data), missing or refused resources, bugs and out-of-memory on the same config.
``retry(fn, ...)`` retries only what is transient, with exponential backoff and random
jitter drawn per call (so ranks and runs never retry in lockstep).
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Callable, Literal, TypeVar

T = TypeVar("T")
Kind = Literal["transient", "permanent"]
TRANSIENT: Kind = "transient"
PERMANENT: Kind = "permanent"
log = logging.getLogger("stoker.retry")


class StokerError(Exception):
    """Base of the project's own errors; `transient` says whether a retry can help."""

    transient = False


ERROR_LINE_PREFIX = "stoker: "  # a project error as the user sees it: this, then the error


def error_line(err: StokerError) -> str:
    """A project error as one line (a ConfigError's: lines), as the CLI prints it and as a flow
    run that it ended says it."""
    return f"{ERROR_LINE_PREFIX}{err}"


class ConfigError(StokerError, ValueError):
    """A user mistake in the run configuration; lists every problem with its fix."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the run config:\n{lines}")

    def __reduce__(self):  # picklable with its problems (Prefect persists task exceptions)
        return type(self), (self.problems,)


class DataError(StokerError, ValueError):
    """Bad data input (empty source, undecodable file, missing field); never retried."""


class ShardsDamaged(DataError):
    """A shard set whose bytes did not match its manifest where they landed (it is marked
    invalid in the store, so the data stage rebuilds it); the flow rebuilds it and relaunches
    once by itself."""


class ExportError(StokerError, ValueError):
    """A checkpoint that cannot be exported as asked (not a committed checkpoint of its run and
    model, a model GPT-2 cannot express, an output folder already in use); never retried."""


class CheckpointInvalid(StokerError, ValueError):
    """A checkpoint found damaged where its bytes landed (a host's full check). It is marked
    invalid in the store, so a retry resumes from the next valid one: transient."""

    transient = True


class CheckpointUnavailable(CheckpointInvalid):
    """A checkpoint that is not there to be read: deleted (retention), never committed, or
    already marked invalid. Asking again for the same checkpoint cannot help: permanent. (A
    resume still falls back from it to the next valid one, as from any CheckpointInvalid.)"""

    transient = False


class EvaluationStopped(StokerError, RuntimeError):
    """An evaluation process ended by a stop (Ctrl-C, a cancel from the UI, SIGTERM): what
    stopped it meant it, so it is never retried."""


class NonFiniteError(StokerError, ArithmeticError):
    """Training produced NaN/inf (loss, gradient norm, weights or optimizer state). The same
    config from the same checkpoint would do it again, so it is permanent: fix the learning
    rate (or train.nonfinite) and resume from the last finite checkpoint."""


class SourceUnreachable(StokerError, ConnectionError):
    """A source still failing after the in-task retries; transient, so the task retries."""

    transient = True


SHARDS_DAMAGED = "damaged-shards"  # TrainingFailed.reason of a launch that met a damaged shard set


class TrainingFailed(StokerError, RuntimeError):
    """A training launch ended badly. `reason` says how (error, lost-rank, hang, timeout)."""

    def __init__(self, message: str, transient: bool, reason: str):
        super().__init__(message)
        self.transient, self.reason = transient, reason

    def __reduce__(self):
        return type(self), (str(self), self.transient, self.reason)


class RetriesExhausted(StokerError, ConnectionError):
    """A transient failure that outlasted the retry budget; the caller's caller may retry."""

    transient = True

    def __init__(self, what: str, attempts: int, seconds: float, last_error: str):
        self.what, self.attempts, self.seconds, self.last_error = what, attempts, seconds, last_error
        super().__init__(f"{what} failed after {attempts} attempts in {seconds:.1f}s (last error: {last_error})")

    def __reduce__(self):
        return type(self), (self.what, self.attempts, self.seconds, self.last_error)


class RankAborted(Exception):
    """A BaseException that ended a rank (torch DCP's CheckpointException is one), carried
    as an Exception so torchelastic's @record files it; classify() judges its cause."""


# Exception types (matched by name anywhere in the MRO, so torch, botocore and aiohttp need
# not be imported here) that mean a peer, the network or the store blinked.
_TRANSIENT_TYPES = {
    "Preempted",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "RendezvousTimeoutError",
    "RendezvousClosedError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ServerDisconnectedError",
    "ClientConnectionError",
    "ClientPayloadError",
}
# S3-style error codes that no retry can fix
_PERMANENT_CODES = {
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "InvalidBucketName",
    "NoSuchKey",
    "ExpiredToken",
}
_TRANSIENT_STATUS = {408, 425, 429}
# a collective whose peer died surfaces as a plain RuntimeError from gloo/NCCL
_LOST_PEER = re.compile(
    r"Connection (reset|closed|refused) by peer|Broken pipe|gloo/transport|NCCL (error|communicator)|"
    r"ProcessGroup\w* .*(timed out|aborted)|Socket Timeout",
    re.IGNORECASE,
)
_NOT_THERE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _chain(exc: BaseException) -> list[BaseException]:
    """exc and its causes/contexts, outermost first, without cycles."""
    out, seen, e = [], set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind an error (aiohttp, botocore, httpx/requests), if any."""
    for e in _chain(exc):
        status = getattr(e, "status", None)
        if isinstance(status, int):
            return status
        response = getattr(e, "response", None)
        code = getattr(response, "status_code", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def error_code(exc: BaseException) -> str | None:
    """An S3-style error code ('NoSuchBucket', 'AccessDenied' ...) behind an error, if any."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        for code in _PERMANENT_CODES:
            if code in str(e):
                return code
    return None


def _is_transport(exc: BaseException) -> bool:
    if any(t.__name__ in _TRANSIENT_TYPES for t in type(exc).__mro__):
        return True
    if any(t.__module__.startswith("aiohttp") and t.__name__ == "ClientError" for t in type(exc).__mro__):
        return True  # refused or dropped connections, truncated bodies
    if isinstance(exc, _NOT_THERE):
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


def classify(exc: BaseException | None) -> Kind:
    """Can a retry help? See the module docstring. None (a crash without an exception, a
    killed process) counts as transient."""
    if exc is None:
        return TRANSIENT
    if isinstance(exc, StokerError):
        return TRANSIENT if exc.transient else PERMANENT
    if isinstance(exc, MemoryError):
        return PERMANENT
    inner = getattr(exc, "failures", None)  # torch DCP's CheckpointException: {rank: wrapped}
    if isinstance(inner, dict) and inner:
        causes = [getattr(w, "exc", w) for w in inner.values()]
        kinds = {classify(c) if isinstance(c, BaseException) else PERMANENT for c in causes}
        return PERMANENT if PERMANENT in kinds else TRANSIENT
    if isinstance(exc, RankAborted) and exc.__cause__ is not None:
        return classify(exc.__cause__)
    if error_code(exc) in _PERMANENT_CODES:
        return PERMANENT
    status = http_status(exc)
    if status is not None:
        return TRANSIENT if status in _TRANSIENT_STATUS or status >= 500 else PERMANENT
    chain = _chain(exc)
    if isinstance(exc, _NOT_THERE):
        # fsspec's HTTP info() reports even a refused connection as FileNotFoundError
        return TRANSIENT if any(_is_transport(e) for e in chain[1:]) else PERMANENT
    if _is_transport(exc):
        return TRANSIENT
    if isinstance(exc, RuntimeError) and _LOST_PEER.search(str(exc)):
        return TRANSIENT
    return PERMANENT


def classify_reported(type_name: str, message: str) -> Kind:
    """The verdict on an error known only by its type name and message (an error file of a
    process that is gone): dist/rendezvous/network types and lost-peer messages are transient."""
    if type_name in _TRANSIENT_TYPES or type_name in ("ConnectionError", "TimeoutError") or _LOST_PEER.search(message):
        return TRANSIENT
    return PERMANENT


def is_transient(exc: BaseException | None) -> bool:
    return classify(exc) == TRANSIENT


def describe(exc: BaseException) -> str:
    """The HTTP status, or the innermost cause (fsspec wraps failures in FileNotFoundError)."""
    status = http_status(exc)
    if status:
        return f"HTTP {status}"
    root = _chain(exc)[-1]
    return f"{type(root).__name__}: {root}"


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int | None = None,
    budget_seconds: float | None = None,
    base_delay: float = 0.5,
    max_delay: float = 8.0,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds. A permanent failure is raised at once; a transient one
    is retried with backoff (``base_delay`` doubling to ``max_delay``, times a random factor in
    [0.5, 1.0) drawn per call) while fewer than ``attempts`` were made and the next try starts
    within ``budget_seconds``; then ``RetriesExhausted`` is raised from the last error.
    ``on_retry(attempt, error, delay)`` sees each retried failure."""
    jitter = random.Random()  # seeded from the OS per call: no two callers share a schedule
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as err:
            if not is_transient(err) or isinstance(err, RetriesExhausted):
                raise
            delay = min(max_delay, base_delay * 2 ** (attempt - 1)) * jitter.uniform(0.5, 1.0)
            elapsed = time.monotonic() - start
            out_of_tries = attempts is not None and attempt >= attempts
            out_of_time = budget_seconds is not None and elapsed + delay > budget_seconds
            if out_of_tries or out_of_time:
                raise RetriesExhausted(what, attempt, elapsed, describe(err)) from err
            if on_retry is not None:
                on_retry(attempt, err, delay)
            else:
                log.warning("%s: attempt %d failed (%s); retrying in %.1fs", what, attempt, describe(err), delay)
            time.sleep(delay)
