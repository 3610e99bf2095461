"""Which batches an in-process producer has made, recorded as it makes them (tests that hold the trainer
back until the producer has run ahead)."""

from __future__ import annotations

from a3po.producer.producer import RolloutProducer


def record_produced(monkeypatch) -> list[int]:
    """Patch :class:`RolloutProducer` for the test: the returned list gets each batch index once made."""
    produced: list[int] = []
    produce_next = RolloutProducer._produce_next

    def recording(self, j):
        out = produce_next(self, j)
        produced.append(j)
        return out

    monkeypatch.setattr(RolloutProducer, "_produce_next", recording)
    return produced
