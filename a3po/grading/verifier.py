"""Caller side of the math-verify worker (``a3po.grading.verify_worker``): a bounded ``check(gold, pred)``.

Works from any thread and from inside worker processes (daemonic ones included: the worker is
a ``subprocess``, not a ``multiprocessing`` child). One supervisor process per caller process,
shared by its threads behind a lock; it is started lazily on the first symbolic comparison,
restarted if it ever stops answering, and re-created after ``os.fork`` (a forked caller must
not talk over its parent's pipes). The supervisor enforces each timeout itself; the caller
waits at most ``timeout_s + grace_s`` before killing the whole process group as a last resort.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from a3po.grading.verify_worker import read_frame, write_frame

_WORKER_SCRIPT = Path(__file__).with_name("verify_worker.py")
# Run the worker by path with sys.path[0] removed, so neither the caller's cwd nor this folder
# (which holds modules named like common top-level packages) can shadow what sympy imports.
_LAUNCH = ("import runpy, sys; sys.path.pop(0); sys.argv = sys.argv[1:]; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")


class GraderUnavailable(RuntimeError):
    """The math-verify worker cannot work (it did not start, or failed its self-check); the
    message says why. RL rewards raise it rather than train on zeros."""


@dataclass(frozen=True)
class Outcome:
    equal: bool
    timed_out: bool = False
    error: str | None = None


class Verifier:
    """A lazily started math-verify supervisor; ``check`` is thread-safe and always bounded."""

    def __init__(
        self, memory_limit_mb: int = 2048, startup_timeout_s: float = 120.0, grace_s: float = 5.0, python: str = ""
    ) -> None:
        self.memory_limit_mb = memory_limit_mb
        self.python = python or sys.executable  # the interpreter that runs the worker (needs math-verify)
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.starts = 0  # supervisor processes started (restarts included)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        _LIVE.add(self)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the supervisor now (otherwise the first symbolic check does)."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        with self._lock:
            self._kill()

    @property
    def pid(self) -> int | None:
        """Process id of the running supervisor (its evaluator child is a fork of it), else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _ensure_started(self) -> subprocess.Popen:
        if self._owner_pid != os.getpid():  # we are a forked copy: the process is our parent's
            self._proc, self._owner_pid = None, os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        cmd = [self.python, "-c", _LAUNCH, str(_WORKER_SCRIPT), str(self.memory_limit_mb)]
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                start_new_session=True,  # its own process group, so one killpg also ends the evaluator child
                close_fds=True,
            )
        except OSError as e:
            raise GraderUnavailable(f"math-verify worker could not be run with {self.python}: {e}") from e
        self.starts += 1
        try:
            ready = read_frame(proc.stdout.fileno(), time.monotonic() + self.startup_timeout_s)
            why = None
        except TimeoutError:
            ready, why = None, f"it did not answer within {self.startup_timeout_s:.0f}s"
        if not ready or not ready.get("ready"):
            if ready is None and why is None:
                try:  # EOF: let it finish exiting, so its own exit code is reported
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self._proc = proc
            self._kill()
            if ready is not None:  # it ran, and said why it cannot work
                why = ready.get("error") or "it reported that it is not ready"
            elif why is None:  # EOF before the ready frame: it died (its traceback is on stderr)
                why = (f"it exited with code {proc.returncode} before it was ready; "
                       f"is math-verify installed for {self.python}?")
            raise GraderUnavailable(f"math-verify worker did not start ({self.python} {_WORKER_SCRIPT}): {why}")
        self._proc = proc
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    # ------------------------------------------------------------ the call
    def check(self, gold: str, pred: str, timeout_s: float) -> Outcome:
        """Is ``pred`` equal to ``gold`` (bare answers) by math-verify? Returns within about
        ``timeout_s`` (plus ``grace_s`` in the worst case, plus the supervisor's start-up of
        about a second on the first call or after it had to be killed)."""
        with self._lock:
            proc = self._ensure_started()
            try:
                write_frame(proc.stdin.fileno(), {"g": gold, "p": pred, "t": timeout_s})
                reply = read_frame(proc.stdout.fileno(), time.monotonic() + timeout_s + self.grace_s)
            except (TimeoutError, OSError, ValueError):  # ValueError: a frame that is not JSON
                reply = None
            if reply is None:  # the supervisor itself failed: start afresh next time
                self._kill()
                return Outcome(False, timed_out=True, error="supervisor unresponsive")
        return Outcome(bool(reply.get("ok")), bool(reply.get("timeout")), reply.get("err"))


_LIVE: "weakref.WeakSet[Verifier]" = weakref.WeakSet()


def _close_all() -> None:
    for v in list(_LIVE):
        v._kill()


def _after_fork_in_child() -> None:
    # The parent's pipes and lock state are not ours: forget them without killing anything.
    for v in list(_LIVE):
        v._lock = threading.Lock()
        v._proc = None
        v._owner_pid = os.getpid()


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
