"""The chunk tuner of OPPO's intra-step overlap (a3po.oppo.chunk_tuner) is checkpointed: a resumed run
continues its schedule (probe or exploit, the candidates' costs, steps since the probe) instead
of probing again from the start.

A micro PPO run (loglinear, max staleness 2: the producer runs up to two batches ahead of the
trainer), chunk_min 1, chunk_max 4 -> candidates 1, 2, 4; chunk_probe_every 2. The tuner's rules
give, for steps 1..8 (unless a step's mean answer length leaves +-25% of the probe's, which
re-probes early; the test checks from the logged lengths that none did):

    step   1 2 3 | 4 5   | 6 7 8
    chunk  1 2 4 | b b   | 1 2 4      (b = cheapest of the first probe; re-probe after 2 exploit steps)

The run is crashed after step 3 (last checkpoint: step 2, mid-probe) and after step 5 (last
checkpoint: step 4, exploiting), and resumed each time. A tuner restarted at a resume would
use 1, 2, 4, b from the resumed step on: step 3 would use 1 instead of 4, and steps 5, 6 would
use 1, 2 instead of b, 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from a3po.config import preset, with_overrides
from tests.support.resume import Crash, crash_after

pytestmark = pytest.mark.usefixtures("core_one_thread")

CFG = with_overrides(
    preset("micro"),
    rl={"advantage": "gae", "variant": "loglinear", "steps": 8, "checkpoint_every": 2, "eval_every": 8, "keep_checkpoints": 10},
    ppo={"critic": "policy_copy", "critic_lr": 1e-3, "kl_coef": 0.05, "kl_estimator": "k3"},
    oppo={"intra": True, "chunk_min": 1, "chunk_max": 4, "chunk_probe_every": 2},
)


@pytest.fixture(scope="module")
def micro_warmstart(tmp_path_factory):
    from a3po.training.run import prepare_warmstart

    return prepare_warmstart(preset("micro"), tmp_path_factory.mktemp("cache"), log=lambda s: None)


def _run(ws_dir: str, ckpt_dir: Path, crash_at: int | None = None):
    from a3po.data.datasets import load_rows
    from a3po.models.factory import load_pretrained
    from a3po.training.loop import rl_train

    model, tok = load_pretrained(ws_dir)
    train, held, _ = load_rows(CFG.data, tok)
    progress = crash_after(crash_at) if crash_at is not None else None
    return rl_train(CFG, model, tok, train, held[:4], ckpt_dir=str(ckpt_dir), warmstart_acc=0.0, progress=progress)


def _tuner_state(ckpt_dir: Path, step: int) -> dict:
    from a3po.storage.checkpoint import load_checkpoint

    return load_checkpoint(ckpt_dir / f"step_{step:06d}")["intra_state"]["chunk_tuner"]


@pytest.mark.e2e
def test_resumed_run_continues_the_chunk_tuners_schedule(core_stub_rewards, micro_warmstart, tmp_path):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Crash):
        _run(micro_warmstart[0], ckpt, crash_at=3)
    # After batch 2 (not after the batches the producer had made ahead): candidate 4 still to probe.
    at2 = _tuner_state(ckpt, 2)
    assert (at2["probe"], sorted(at2["costs"]), at2["probes"]) == ([4], ["1", "2"], 1)

    with pytest.raises(Crash):
        _run(micro_warmstart[0], ckpt, crash_at=5)
    # After batch 4: probe over (costs of all three), one exploit step done, on the cheapest.
    at4 = _tuner_state(ckpt, 4)
    best = at4["best"]
    assert (at4["probe"], sorted(at4["costs"], key=int), at4["exploit_steps"], at4["probes"]) == ([], ["1", "2", "4"], 1, 1)

    res = _run(micro_warmstart[0], ckpt)
    assert res.resumed_from == 4 and len(res.history) == 8
    # The probe's costs from what steps 1-3 logged (chunk 1, 2, 4): a step's cost is its
    # producing time per generated token, i.e. (generate-and-score time - score time) over
    # (mean answer length x 8 answers: 4 prompts x group 2). The best chunk is the cheapest.
    probed = zip((1, 2, 4), res.history[:3], strict=True)
    hand = {str(c): (m["perf/gen_time_s"] - m["perf/score_s"]) / (m["response/length_mean"] * 8) for c, m in probed}
    assert at4["costs"] == pytest.approx(hand, rel=1e-6)
    assert best == int(min(hand, key=hand.get))
    lengths = [m["response/length_mean"] for m in res.history]
    probe_len = sum(lengths[:3]) / 3
    assert all(abs(x - probe_len) <= 0.25 * max(probe_len, 1.0) for x in lengths[3:5]), lengths  # no early re-probe
    # Steps 1-2 and 3-4 come from the checkpoints of the crashed attempts (their history), 5-8 from this one.
    sizes = [int(m["oppo/chunk_size"]) for m in res.history]
    assert sizes[:5] == [1, 2, 4, best, best]
    # The re-probe (docs/oppo.md): the best size and its neighbours on the ladder 1, 2, 4; then the
    # cheapest of those, which depends on timing.
    reprobe = {1: [1, 2], 2: [1, 2, 4], 4: [2, 4]}[best]
    assert sizes[5:5 + len(reprobe)] == reprobe, sizes
    assert all(s in reprobe for s in sizes[5 + len(reprobe):]), sizes
    assert _tuner_state(ckpt, 8)["probes"] == 2  # the second probe, counted on from the checkpoint's 1
