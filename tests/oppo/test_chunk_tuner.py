"""Online chunk-size tuning (a3po.oppo.chunk_tuner): candidates, probe -> exploit -> re-probe on a
schedule or on a shift of the answer lengths, and a state that survives JSON."""

from __future__ import annotations

import json

import pytest

from a3po.oppo.chunk_tuner import ChunkTuner, chunk_candidates


def test_candidates_are_the_bounds_and_powers_of_two_between():
    assert chunk_candidates(1, 16) == [1, 2, 4, 8, 16]
    assert chunk_candidates(3, 20) == [3, 4, 8, 16, 20]
    assert chunk_candidates(5, 5) == [5]
    with pytest.raises(ValueError, match="chunk_min <= chunk_max"):
        chunk_candidates(8, 4)


def _run(tuner, cost_per_token, length=10.0, tokens=100):
    size = tuner.chunk_size()
    tuner.record(cost_per_token[size] * tokens, tokens, length)
    return size


def test_probes_every_candidate_once_then_keeps_the_fastest():
    t = ChunkTuner(1, 8, probe_every=3)
    cost = {1: 0.5, 2: 0.2, 4: 0.1, 8: 0.3}  # seconds per token: 4 is fastest
    assert [_run(t, cost) for _ in range(4)] == [1, 2, 4, 8]
    assert not t.probing and t.best == 4
    # 3 exploit steps, then a new probe of the best and its neighbours only.
    assert [_run(t, cost) for _ in range(3)] == [4, 4, 4]
    assert t.probing and t.chunk_size() == 2 and t.probes == 2
    cost = {1: 0.5, 2: 0.2, 4: 0.3, 8: 0.1}  # now 8 is the fastest
    assert [_run(t, cost) for _ in range(3)] == [2, 4, 8] and t.best == 8
    assert [_run(t, cost) for _ in range(3)] == [8, 8, 8]
    assert [_run(t, cost) for _ in range(2)] == [4, 8]  # the top of the ladder has one neighbour


def test_a_length_shift_triggers_a_new_probe_early():
    t = ChunkTuner(2, 4, probe_every=100, shift=0.25)
    cost = {2: 0.1, 4: 0.2}
    _run(t, cost, length=10), _run(t, cost, length=10)
    assert t.best == 2 and not t.probing
    _run(t, cost, length=12)  # +20%: within the band
    assert not t.probing
    _run(t, cost, length=30)  # x3: the length distribution moved
    assert t.probing and t.probes == 2


def test_ties_go_to_the_smaller_chunk_and_state_round_trips_json():
    t = ChunkTuner(1, 4, probe_every=5)
    for _ in range(3):
        _run(t, {1: 0.1, 2: 0.1, 4: 0.1})
    assert t.best == 1  # equal cost: the smaller chunk overlaps more
    _run(t, {1: 0.1})
    u = ChunkTuner(1, 4, probe_every=5)
    u.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert u.state_dict() == t.state_dict() and u.chunk_size() == t.chunk_size()


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="probe_every"):
        ChunkTuner(1, 4, probe_every=0)
    with pytest.raises(ValueError, match="shift"):
        ChunkTuner(1, 4, shift=0)
