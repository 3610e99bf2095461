"""The admission bound moved mid-run (``Admission.set_bound``): raised, a blocked producer is woken
and admits at once; lowered, it waits longer; never outside [0, the bound the store was built for]."""

from __future__ import annotations

import threading

import pytest

from a3po.producer.producer import Admission
from a3po.producer.weight_store import WeightStore


def test_a_raised_bound_wakes_a_waiting_admission():
    store = WeightStore()
    store.publish(0, {})
    adm = Admission(store, max_staleness=1, batch_size=4, limit=3)  # capacity at version 0: (1 + 0 + 1) * 4 = 8
    adm.admit(8)
    done = threading.Event()
    th = threading.Thread(target=lambda: (adm.admit(4), done.set()), daemon=True)
    try:
        th.start()
        assert not done.wait(0.3)  # 12 > 8: blocked, no new version comes
        adm.set_bound(2)  # capacity (2 + 0 + 1) * 4 = 12
        # Woken by the bound's notify: well before the store's 1 s re-check would let it see the new bound.
        assert done.wait(0.6) and adm.admitted == 12
    finally:
        store.close()
        th.join(timeout=5)


def test_a_lowered_bound_holds_the_next_admission_back_until_versions_catch_up():
    store = WeightStore()
    store.publish(0, {})
    adm = Admission(store, max_staleness=3, batch_size=4)
    adm.admit(8)  # within (3 + 0 + 1) * 4 = 16
    adm.set_bound(1)  # (1 + 0 + 1) * 4 = 8: the next batch waits for version 1
    done = threading.Event()
    th = threading.Thread(target=lambda: (adm.admit(4), done.set()), daemon=True)
    try:
        th.start()
        assert not done.wait(0.3)
        store.publish(1, {})  # capacity (1 + 1 + 1) * 4 = 12
        assert done.wait(5) and adm.admitted == 12
    finally:
        store.close()
        th.join(timeout=5)


def test_the_bound_moves_within_the_limit_the_store_was_built_for():
    adm = Admission(WeightStore(), max_staleness=1, batch_size=4, limit=3)
    adm.set_bound(3)
    adm.lower(2)  # the guard's lowering still works, and still only lowers
    with pytest.raises(ValueError, match="only be lowered, from 2, got 3"):
        adm.lower(3)
    with pytest.raises(ValueError, match="moves within \\[0, 3\\]"):
        adm.set_bound(4)
    with pytest.raises(ValueError, match="outside \\[0, 2\\]"):
        Admission(WeightStore(), max_staleness=3, batch_size=4, limit=2)
    assert Admission(WeightStore(), max_staleness=2, batch_size=4).limit == 2  # default: the starting bound
