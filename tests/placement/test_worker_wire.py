"""A batch's trip from a rollout worker to the trainer (a3po/placement/worker_wire.py), through a
fake wire: each tensor ``put`` lands in a list, and each ``take`` copies the next one into the
tensor given, of the same dtype and shape (as a gloo send / recv pair needs).

The wire format is read off the batch's own fields (:func:`batch_fields`): every field of an
ordinary batch arrives equal, its tensors byte for byte in their dtype, and a field added to the
batch (a dataclass extending :class:`ScoredBatch`) arrives too, with no edit of the wire code;
a field no rule carries is refused, naming it, never dropped.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from a3po.placement.worker_wire import STOP, batch_fields, put_batch, put_failure, take_batch
from a3po.producer.producer import ScoredBatch
from a3po.rollout.types import RolloutBatch


class FakeWire:
    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def put(self, t: torch.Tensor) -> None:
        self.sent.append(t.clone())

    def take(self, t: torch.Tensor) -> None:
        src = self.sent.pop(0)
        assert (src.dtype, src.shape) == (t.dtype, t.shape), "the receiver must expect what was sent"
        t.copy_(src)


def _trip(batch, cls: type = ScoredBatch):
    wire = FakeWire()
    put_batch(batch, wire.put)
    got = take_batch(wire.take, torch.device("cpu"), cls)
    assert not wire.sent, "the receiver takes every tensor sent"
    return got


def _batch() -> ScoredBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (3, 7), generator=g)
    behav = torch.randn(3, 7, generator=g)
    behav[0, 0], behav[1, 1], behav[2, 2] = float("nan"), -0.0, float("-inf")  # bytes, not values, must arrive
    rollout = RolloutBatch(ids, torch.ones_like(ids), torch.rand(3, 7, generator=g) > 0.5, behav,
                           torch.randint(-1, 4, (3, 7), generator=g), torch.tensor([True, False, True]), 4,
                           [{"id": i, "gold": "7", "group": i // 2} for i in range(3)])
    return ScoredBatch(5, rollout, torch.tensor([1.0, 0.0, 0.5]), ["a", "b", "c"], 0.1 + 0.2, {"calls": 3},
                       {"perf/x": 1e-300, "rollout/behav_logp_max": 0.125},
                       producer_state={"buffer": {"groups": [[{"logp": [0.1 + 0.2]}]]}, "next_group": 5},
                       stream_state={"chunk_tuner": {"size": 4}},
                       streamed={"ref_logp": torch.randn(3, 7, generator=g, dtype=torch.float64),
                                 "scores": torch.rand(3, generator=g).to(torch.bfloat16)})


def _assert_same(got, sent, path: str = "batch") -> None:
    """Every field of ``sent`` in ``got``: tensors in the same dtype and shape with the same bytes,
    dataclasses field by field, the rest equal (floats to the bit)."""
    if isinstance(sent, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), path
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), path
    elif dataclasses.is_dataclass(sent):
        assert type(got) is type(sent), path
        for f in dataclasses.fields(sent):
            _assert_same(getattr(got, f.name), getattr(sent, f.name), f"{path}.{f.name}")
    elif isinstance(sent, dict):
        assert isinstance(got, dict) and list(got) == list(sent), path
        for k in sent:
            _assert_same(got[k], sent[k], f"{path}[{k!r}]")
    elif isinstance(sent, float):
        assert type(got) is float and (got == sent or math.isnan(got) and math.isnan(sent)), path
    else:
        assert type(got) is type(sent) and got == sent, path


def test_an_ordinary_batch_arrives_field_for_field_its_tensors_byte_for_byte_in_their_dtypes():
    sent = _batch()
    got = _trip(sent)
    _assert_same(got, sent)
    assert got.rollout.response_mask.dtype == torch.bool and got.rollout.finished.dtype == torch.bool
    assert got.streamed["scores"].dtype == torch.bfloat16 and got.gen_time_s == 0.30000000000000004
    # No OPPO: no streamed tensors, no states.
    plain = ScoredBatch(0, sent.rollout, sent.rewards, sent.completions, 0.0)
    _assert_same(_trip(plain), plain)


def test_an_error_frame_carries_the_workers_text():
    wire = FakeWire()
    put_failure("worker 1: out of memory", wire.put)
    assert wire.sent[0].tolist()[0] == STOP
    assert take_batch(wire.take, torch.device("cpu")) == "worker 1: out of memory" and not wire.sent


def test_a_field_added_to_the_batch_crosses_the_wire_with_no_edit_of_the_wire_code():
    Extended = dataclasses.make_dataclass("Extended", [  # noqa: N806
        ("extra", torch.Tensor, dataclasses.field(default_factory=lambda: torch.zeros(0))),
        ("maybe", torch.Tensor | None, dataclasses.field(default=None)),
        ("note", dict[str, int], dataclasses.field(default_factory=dict)),
        ("label", str, dataclasses.field(default="")),
    ], bases=(ScoredBatch,))
    base = _batch()
    extra = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    sent = Extended(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ScoredBatch)},
                    extra=extra, maybe=torch.tensor([0.5], dtype=torch.float16), note={"k": 3}, label="x")
    got = _trip(sent, Extended)
    assert torch.equal(got.extra, extra) and got.extra.dtype == torch.int16
    assert (got.note, got.label) == ({"k": 3}, "x")
    _assert_same(got, sent)
    absent = Extended(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ScoredBatch)}, extra=extra)
    assert _trip(absent, Extended).maybe is None  # an optional tensor left out arrives as None


def test_a_field_no_rule_carries_is_refused_by_name():
    Odd = dataclasses.make_dataclass("Odd", [("handles", set[int], dataclasses.field(default_factory=set))],  # noqa: N806
                                     bases=(ScoredBatch,))
    with pytest.raises(TypeError, match=r"Odd\.handles .*cannot travel"):
        batch_fields(Odd)
    with pytest.raises(TypeError, match=r"Odd\.handles"):
        put_batch(Odd(**{f.name: getattr(_batch(), f.name) for f in dataclasses.fields(ScoredBatch)}), FakeWire().put)
    # A value its declaration does not fit: named as well.
    bad = _batch()
    bad.metrics = {"perf/x": torch.tensor(1.0)}
    with pytest.raises(TypeError, match="batch field metrics does not travel as JSON"):
        put_batch(bad, FakeWire().put)
