"""Where the pipeline runs: offline defaults, the temporary Prefect server, the MLflow store.

The embedded default needs no service: Prefect's temporary local server (a subprocess on a
loopback port, SQLite under a project-local ``.prefect``) and an MLflow SQLite file
(``./mlflow.db``). Team mode is the same code with ``PREFECT_API_URL`` and
``MLFLOW_TRACKING_URI`` pointing at real servers (see ``infra/``).

Prefect reads its settings when it is first imported, so :func:`apply_local_defaults` runs
from ``flows/__init__.py`` before anything imports Prefect. It only fills in variables that
are unset, so tests, CI and team mode keep control. This module must not import Prefect at
module level.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

# Telemetry off and quiet model loading; none of these change results.
OFFLINE_DEFAULTS = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # The first start of a fresh temporary server migrates its database: slow on 2 busy cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_local_defaults(root: str | Path | None = None) -> None:
    """Fill unset environment variables: telemetry off and, unless a Prefect API is configured,
    a project-local ``PREFECT_HOME`` (``<root>/.prefect``, root = cwd) so nothing lands in ~/.prefect."""
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        os.environ["PREFECT_HOME"] = str(Path(root or Path.cwd()).resolve() / ".prefect")


def default_tracking_uri(root: str | Path | None = None) -> str:
    """``$MLFLOW_TRACKING_URI``, else a SQLite store ``<root>/mlflow.db`` (absolute path, so a
    stray ``./mlruns`` can never take over)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path(root or Path.cwd()).resolve() / 'mlflow.db')}"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The file behind a ``sqlite:///`` URI, None for other stores."""
    prefix = "sqlite:///"
    return Path(tracking_uri[len(prefix):]) if tracking_uri.startswith(prefix) else None


def run_logger():
    """Prefect's run logger inside a flow or task run; a plain logger when a task is called
    through ``.fn()`` (tests), where Prefect has no run context."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        import logging

        return logging.getLogger("a3po.tasks")


@contextlib.contextmanager
def prefect_api(startup_timeout_s: int | None = None) -> Iterator[dict]:
    """Yield ``{"api_url", "temporary", "startup_s", "pid"}``. With ``PREFECT_API_URL`` set, that
    server; otherwise start Prefect's temporary local server here (instead of lazily inside
    the first flow call) so its start-up is timed and it is stopped before the caller prints
    its final JSON line."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield {"api_url": configured, "temporary": False, "startup_s": 0.0, "pid": None}
        return
    from prefect.server.api import server as prefect_server

    t0 = time.perf_counter()
    server = prefect_server.SubprocessASGIServer()
    # The server in its own session: a SIGTERM or Ctrl-C sent to our process group (a terminal, a
    # CI timeout) would stop it too, and the flow would then retry the dead server for minutes
    # before exiting. It stops with us instead: below, or by the kernel if we are killed.
    spawn = prefect_server.subprocess
    prefect_server.subprocess = _OwnSession()  # read by the server's start() only; restored at once
    try:
        server.start(timeout=startup_timeout_s or int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")))
    finally:
        prefect_server.subprocess = spawn
    info = {"api_url": server.api_url, "temporary": True, "startup_s": time.perf_counter() - t0, "pid": server.server_process.pid}
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield info
            finally:  # on failure too: else the workers retry a stopped server at exit (~85 s)
                _drain_to_api()
    finally:
        server.stop()


class _OwnSession:
    """``subprocess`` with ``Popen`` starting its child in a new session that receives SIGTERM
    when this process dies (Linux ``PR_SET_PDEATHSIG``; elsewhere only the new session)."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args, **kwargs):  # the name it stands in for
        return subprocess.Popen(*args, **kwargs, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _drain_to_api() -> None:
    """Send Prefect's queued logs and events while the server is still up (otherwise their
    workers retry a stopped server at exit, for a minute, and print errors after our output).
    Never raises: it runs on the way out of a failed flow as well."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=10)
        except Exception:  # noqa: BLE001 - best effort; the flow's own outcome matters more
            pass
