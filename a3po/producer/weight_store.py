"""Versioned policy weights shared by the trainer (which publishes them) and the producer (which
samples with them), and the rule for how long a version is kept. A version is what training
changes (:func:`clone_state`): the whole state dict, or with ``model.lora`` the adapters alone.

A version is kept while a batch not yet trained can still read it: a batch in flight or queued,
one admitted later, one regenerated after a resume from a checkpoint written now (samples carried
over to a later batch keep only version numbers, not weights). That set depends on the schedule, not on how
large ``max_staleness`` is: with ``s = 10**9`` the deterministic schedule starts every batch on
version 0, so it keeps version 0 and the newest one, not every version in between.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from a3po.models.lora import trained_state


class Stopped(Exception):
    """The weight store was closed (the run is stopping) while a thread was waiting on it."""


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights training changes, on the model's own device and dtype: the whole
    state dict, or a LoRA policy's adapters alone (its frozen base is the same in every version;
    :mod:`a3po.models.lora`)."""
    return {k: v.detach().clone() for k, v in trained_state(model).items()}


class Retention:
    """Which versions a store keeps once version ``latest`` is published, for a run whose
    batches ``0 .. end - 1`` are sampled under staleness bound ``s``.

    The trainer publishes version ``L`` after training batch ``L - 1``, so every batch still in
    flight, queued or to come has index ``j >= L``. Under the ``deterministic`` schedule batch
    ``j`` reads version ``max(0, j - s)`` and, halfway, ``j - s + 1``, so the versions that can
    still be read are ``{L} ∪ [max(0, L - s), max(0, end - s)]``: ``s + 1`` of them in the
    steady state, two (``0`` and ``L``) when ``s >= end``. Under ``threaded`` a batch starts on the
    newest version and loads newer ones as they come: only the newest is needed to start or
    resume, and a producer :meth:`hold`\\s the version its batch in progress started on (its
    tokens' versions are read back after decoding, by the behaviour check). Holds are shared by
    every store built on this object (e.g. a critic's versions published beside the
    policy's).
    """

    def __init__(self, max_staleness: int, schedule: str = "deterministic", end: int | None = None) -> None:
        if schedule not in ("deterministic", "threaded"):
            raise ValueError(f"schedule must be 'deterministic' or 'threaded', got {schedule!r}")
        self.max_staleness, self.schedule, self.end = max_staleness, schedule, end
        self._holds: dict[str, int] = {}
        self._lock = threading.Lock()

    def hold(self, owner: str, version: int) -> None:
        """Keep every version ``>= version`` for ``owner`` (one hold per owner, replaced)."""
        with self._lock:
            self._holds[owner] = version

    def release(self, owner: str) -> None:
        with self._lock:
            self._holds.pop(owner, None)

    def needed(self, version: int, latest: int) -> bool:
        """Whether a batch not yet trained (or regenerated after a resume) can read ``version``."""
        if version == latest:
            return True
        if self.schedule == "threaded":
            return False
        upper = None if self.end is None else max(0, self.end - self.max_staleness)
        return max(0, latest - self.max_staleness) <= version and (upper is None or version <= upper)

    def keeps(self, version: int, latest: int) -> bool:
        with self._lock:
            held = any(version >= v for v in self._holds.values())
        return held or self.needed(version, latest)


class WeightStore:
    """Versioned weights; on each publish, drops the versions ``retention`` no longer needs
    (without one, keeps them all: tests and tools with a handful of versions)."""

    def __init__(self, retention: Retention | None = None) -> None:
        self.retention = retention
        self.cond = threading.Condition()
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self.latest = -1
        self.closed = False

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self.cond:
            self._weights[version] = state
            self.latest = max(self.latest, version)
            if self.retention is not None:
                for v in [v for v in self._weights if not self.retention.keeps(v, self.latest)]:
                    del self._weights[v]
            self.cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            while not predicate():
                if self.closed:
                    raise Stopped()
                self.cond.wait(timeout=1.0)

    def get(self, version: int) -> dict[str, torch.Tensor]:
        self.wait_until(lambda: self.latest >= version)
        with self.cond:
            if version not in self._weights:
                raise KeyError(f"policy version {version} is no longer kept (have {sorted(self._weights)})")
            return self._weights[version]

    def versions(self) -> list[int]:
        with self.cond:
            return sorted(self._weights)

    def nbytes(self) -> int:
        """Bytes held by the kept versions (what a huge ``max_staleness`` used to grow)."""
        with self.cond:
            return sum(t.numel() * t.element_size() for s in self._weights.values() for t in s.values())

    def history(self, since: int | None = None) -> dict[int, dict[str, torch.Tensor]]:
        """The kept versions (from ``since`` on): what a checkpoint needs to regenerate the batches
        in flight, or what rollout workers start from."""
        with self.cond:
            return {v: s for v, s in self._weights.items() if since is None or v >= since}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
