"""What each variant, rollout correction and placement means for a run, on the plan alone
(:class:`a3po.config.plan.RunPlan`). The expected values are written from docs/variants.md and the
placement and core docs (a3po/placement/cores.py, a3po/producer/weight_store.py), not recomputed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from a3po.config import RLConfig, RunPlan, Variant, preset, with_overrides
from a3po.config.plan import evaluation_threads
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.parallel.ranks import Ranks
from a3po.placement.in_process import weight_retention
from a3po.training.step import rollout_correction


def _plan(cores: int = 8, **sections) -> RunPlan:
    # Thread settings fixed here, so that the preset's own do not decide the budgets below.
    threads = {"torch_threads": 1, "update_threads": 0, "generate_threads": 0}
    return RunPlan.of(with_overrides(preset("micro"), **{**threads, **sections}), cores=cores)


def test_sync_never_runs_ahead_and_its_proximal_is_the_behaviour_policy():
    # sync: "max_staleness = 0, so d = 0 and pi_prox = pi_behav: the loss is PPO-clip", whatever rl.max_staleness says
    plan = _plan(rl={"variant": "sync", "max_staleness": 3})
    assert plan.variant is Variant.SYNC
    assert (plan.max_staleness, plan.proximal, plan.proximal_forward) == (0, "behaviour", False)


def test_recompute_runs_ahead_by_max_staleness_and_pays_an_extra_forward():
    plan = _plan(rl={"variant": "recompute", "max_staleness": 3})
    assert (plan.max_staleness, plan.proximal, plan.proximal_forward) == (3, "recompute", True)


def test_loglinear_runs_ahead_by_max_staleness_without_a_forward():
    plan = _plan(rl={"variant": "loglinear", "max_staleness": 2})
    assert (plan.max_staleness, plan.proximal, plan.proximal_forward) == (2, "loglinear", False)
    # an asynchronous variant with a bound of 0 is on-policy too
    assert _plan(rl={"variant": "loglinear", "max_staleness": 0}).max_staleness == 0


def test_rl_proximal_overrides_the_variants_method_but_not_its_bound():
    # metrics trains with recompute's forward and re-scores each batch to log the engine's error
    plan = _plan(rl={"variant": "loglinear", "max_staleness": 2, "proximal": "metrics"})
    assert (plan.max_staleness, plan.proximal, plan.proximal_forward, plan.rescore) == (2, "metrics", True, True)
    plan = _plan(rl={"variant": "sync", "proximal": "recompute"})
    assert (plan.max_staleness, plan.proximal, plan.proximal_forward, plan.rescore) == (0, "recompute", True, False)


@pytest.mark.parametrize(
    "rl, source, rescore",
    [
        ({"variant": "loglinear"}, None, False),  # none: nothing computed
        ({"variant": "sync", "rollout_correction": "tis"}, "trainer", False),  # on-policy: a forward at the step's start
        ({"variant": "sync", "proximal": "recompute", "rollout_correction": "tis"}, "trainer", False),  # the proximal one
        ({"variant": "recompute", "max_staleness": 0, "rollout_correction": "icepop"}, "trainer", False),  # bound 0
        ({"variant": "loglinear", "max_staleness": 2, "rollout_correction": "icepop"}, "producer", True),  # re-scored
        ({"variant": "recompute", "max_staleness": 1, "rollout_correction": "mis"}, "producer", True),
    ],
)
def test_where_the_trainers_logprobs_of_the_behaviour_versions_come_from(rl, source, rescore):
    plan = _plan(rl=rl)
    assert (plan.trainer_logp, plan.rescore) == (source, rescore)


def test_placement_follows_rollout_workers():
    assert _plan().placement == "colocated"
    # rollout workers with a correction run synchronously: the trainer computes the log-probs, the workers re-score nothing
    plan = _plan(rl={"variant": "sync", "rollout_correction": "tis"}, distributed={"rollout_workers": 2})
    assert (plan.placement, plan.trainer_logp, plan.rescore) == ("disaggregated", "trainer", False)


def _kept(plan: RunPlan, latest: int) -> list[int]:
    retention = weight_retention(plan)
    return [v for v in range(latest + 1) if retention.needed(v, latest)]


def test_a_store_keeps_the_versions_a_batch_not_yet_trained_can_read():
    # deterministic: batch j reads max(0, j - s), then j - s + 1; after version L: {L} and [max(0, L - s), max(0, end - s)]
    async_plan = _plan(rl={"variant": "loglinear", "max_staleness": 2, "steps": 10})
    assert (async_plan.schedule, async_plan.steps) == ("deterministic", 10)
    assert _kept(async_plan, 5) == [3, 4, 5]
    # a run shorter than its bound: batches 0 and 1 read version max(0, j - 3) = 0 only, so 1 goes once 2 is out
    assert _kept(_plan(rl={"variant": "loglinear", "max_staleness": 3, "steps": 2}), 2) == [0, 2]
    assert _kept(_plan(rl={"variant": "sync", "max_staleness": 2, "steps": 10}), 5) == [5]  # on-policy: the newest only
    # threaded: a batch starts on the newest version (and a producer holds the one its batch started on)
    assert _kept(_plan(rl={"variant": "loglinear", "max_staleness": 2, "steps": 10, "schedule": "threaded"}), 5) == [5]


def test_sync_in_one_process_gives_each_phase_every_core_async_variants_keep_torch_threads():
    plan = _plan(cores=8, rl={"variant": "sync"})
    assert (plan.alternate, plan.update_threads, plan.generate_threads) == (True, 8, 8)  # 0: every core
    plan = _plan(cores=8, rl={"variant": "sync"}, update_threads=3, generate_threads=1)
    assert (plan.update_threads, plan.generate_threads) == (3, 1)  # as asked
    plan = _plan(cores=8, rl={"variant": "sync"}, torch_threads=12)
    assert (plan.update_threads, plan.generate_threads) == (12, 12)  # never fewer than torch_threads
    for variant in ("recompute", "loglinear"):  # the producer decodes while the trainer trains
        plan = _plan(cores=8, rl={"variant": variant}, torch_threads=2, update_threads=3)
        assert (plan.alternate, plan.update_threads, plan.generate_threads) == (False, 2, 2)


def test_an_evaluation_decodes_on_the_cores_a_synchronous_steps_generation_gets():
    # It runs alone after training: generate_threads, 0 meaning every core, never below torch_threads.
    smol_like = with_overrides(preset("micro"), torch_threads=1, generate_threads=0)
    assert evaluation_threads(smol_like, cores=2) == 2
    assert evaluation_threads(smol_like, cores=16) == 16
    as_shipped = with_overrides(preset("micro"), torch_threads=1, generate_threads=1)
    assert evaluation_threads(as_shipped, cores=16) == 1  # tiny's evaluations keep their one thread (and bits)
    assert evaluation_threads(with_overrides(preset("micro"), torch_threads=3, generate_threads=1), cores=16) == 3
    assert evaluation_threads(with_overrides(preset("micro"), torch_threads=1, generate_threads=4), cores=16) == 4
    assert evaluation_threads(preset("smol"), cores=2) == 2  # the pretrained preset decodes on both cores here


@pytest.mark.parametrize(
    "sections",
    [
        {"distributed": {"rollout_workers": 1}},  # the workers generate in processes of their own
        {"distributed": {"deepspeed_config": "ds.json"}},  # other trainer ranks share the machine
        {"rl": {"variant": "sync", "proximal": "recompute"}, "oppo": {"inter": True}},  # the overlap producer runs ahead
    ],
)
def test_sync_beside_other_computing_keeps_torch_threads(sections):
    plan = _plan(cores=8, **{"rl": {"variant": "sync"}, **sections, "torch_threads": 2})
    assert plan.max_staleness == 0
    assert (plan.alternate, plan.update_threads, plan.generate_threads) == (False, 2, 2)


def test_a_step_without_the_plans_source_refuses_a_correction_that_needs_one():
    cfg = RLConfig(variant="sync", rollout_correction="tis")
    with pytest.raises(ValueError, match="needs the trainer's log-probs"):
        rollout_correction(None, SimpleNamespace(rollout=None), cfg, None, None, source=None)


def test_the_loop_takes_the_ranks_and_the_plan_it_is_handed(core_stub_rewards, core_one_thread, monkeypatch):
    import a3po.training.loop as loop

    cfg = with_overrides(preset("micro"), rl={"steps": 1, "variant": "sync", "rollout_correction": "tis"}, update_threads=1)
    plan = RunPlan.of(cfg, cores=1)

    def resolved_again(*args, **kwargs):
        raise AssertionError("the ranks or the plan were resolved again below the caller")

    monkeypatch.setattr(loop, "init_ranks", resolved_again)
    monkeypatch.setattr(RunPlan, "of", resolved_again)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = loop.rl_train(cfg, model, tok, train, held, warmstart_acc=0.0, ranks=Ranks(), plan=plan)
    assert "correction/ratio_max" in res.history[0]  # the plan's log-prob source reached the step
