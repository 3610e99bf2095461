"""The A-3PO paper's claims, checked against one comparison run of this testbed.

One row of :data:`CLAIMS` per claim: what the paper says (its figure, or, where no figure could
be found in the sources read, the claim in words, marked "qualitative": never a number made up
here), where it says it, the quantity measured here per seed, and the rule. Every rule has the
same form, **value OP threshold on every seed**, and decides:

- **reproduced**: every seed's value passes the test;
- **not reproduced**: at least one seed's value fails it (the reason names the worst seed);
- **not measurable here**: the quantity does not exist in this run (a variant not run, no
  reward target because nothing improved, a seed that never reached the target, no variant
  clipped anything), with the reason.

Seeds are paired: the variants of one seed share the warm start, the prompt stream and the
sampler seed, so per-seed differences and ratios compare like with like. The testbed's figure is
shown with its spread over seeds (mean +- sample std, min..max). Measured quantities come from the
comparison rows of :func:`tasks.summary.compare` (``row["per_seed"]``, definitions there):

==================  ===================================================  ========  ==============================
claim               value per seed                                       rule      why this threshold
==================  ===================================================  ========  ==============================
prox_time           prox time/step recompute / loglinear (``prox/time_s``) >= 10   "no forward pass": an order of
                                                                                   magnitude; the paper's 8,500x
                                                                                   grows with model size
ttt_vs_recompute    time to target recompute / loglinear                   > 1     faster, whatever the margin
ttt_vs_sync         time to target sync / loglinear                        > 1     faster, whatever the margin
reward_parity       final reward loglinear - recompute                     >= -0.05 "comparable": within 5 reward
                                                                                   points (rewards are 0..1)
behav_iw_extremes   max behaviour IW loglinear / recompute                 < 1     "more controlled": smaller;
                                                                                   not measurable where both
                                                                                   maxima are 1 to float rounding
                                                                                   (no stale token)
clipped_tokens      clipped fraction loglinear - fewest of the others      <= 0    "clips the fewest" (ties pass)
==================  ===================================================  ========  ==============================

**Reward parity where a calibration covers the run.** The -0.05 threshold is per seed and was
set on ``tiny``, whose healthy seed-to-seed spread is a fraction of it; on a setting with a recorded
calibration (:data:`tasks.parity.CALIBRATIONS`: ``smol`` at 10 steps, whose healthy difference
has an sd of ~0.055 per seed) it would fail healthy runs on some seeds. There the claim is judged
by the calibrated shortfall rule instead (:func:`tasks.pairs.calibrated_shortfall`: loglinear
against recompute and sync pooled, FAIL iff the mean difference over the set's seeds is below the
calibrated line), the set's per-seed differences still shown, the reason naming the rule.

**Two seed sets.** A verdict on one set of seeds can flip when the run is repeated on others. With
a second, disjoint set (the flow's replicate seeds), each claim is judged on each set alone, from
that set's runs and its own reward target (:func:`seed_set`), and the two verdicts are combined
(:func:`combine`): the same verdict twice stands; "not measurable here" on either set stands;
two different verdicts are **not settled**, never "reproduced". A claim judged on one set only is
shown as "one seed set: not replicated" beside its verdict.
"""

from __future__ import annotations

import json
import math
import operator
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.arms import Arm
from tasks.parity import ParityResult
from tasks.summary import ArmRun, compare, read_history
from tasks.verdicts import NothingToJudge, all_pass

REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE)
NOT_SETTLED = "not settled"  # the two seed sets disagree
NOT_REPLICATED = "one seed set: not replicated"
SET_NAMES = ("A", "B")  # the seeds, then the replicate seeds

PAPER = "Li, Wu, Shen: A-3PO, arXiv:2512.06547"
BLOG = "authors' blog post (hsiaotsan.github.io/blog/posts/a3po-efficient-async-llm-training)"
AREAL_DOCS = "AReaL docs/algorithms/prox_approx.md (GSM8K, Qwen2.5-1.5B-Instruct, 300 steps, staleness 8)"



@dataclass(frozen=True)
class PaperFigure:
    """A total-training-time ratio the sources give for A-3PO: ``baseline``'s time / A-3PO's, at one
    model size and task. A ratio quoted against the wrong baseline is a wrong claim: the headline
    1.8x is the 8B run against synchronous training (against recompute it is 1.1x)."""

    setting: str
    baseline: str  # "recompute" or "sync"
    ratio: float
    source: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.setting}: {self.ratio:g}x" + (f" ({self.note})" if self.note else "")


TRAINING_TIME_FIGURES: tuple[PaperFigure, ...] = (
    PaperFigure("Qwen2.5-1.5B, GSM8K", "recompute", 1.2, PAPER),
    PaperFigure("Qwen3-8B, DAPO-Math-17k", "recompute", 1.1, PAPER),
    PaperFigure("AReaL docs, Qwen2.5-1.5B-Instruct, GSM8K, 300 steps, staleness 8", "recompute", 1.27, AREAL_DOCS,
                "207 -> 163 min"),
    PaperFigure("Qwen2.5-1.5B, GSM8K", "sync", 1.5, PAPER),
    PaperFigure("Qwen3-8B, DAPO-Math-17k", "sync", 1.8, PAPER, "26.15 h -> 14.54 h: the headline figure"),
)


def figures_against(baseline: str) -> str:
    """The sources' training-time ratios of A-3PO against ``baseline``, one per setting."""
    figures = [f for f in TRAINING_TIME_FIGURES if f.baseline == baseline]
    if not figures:
        raise ValueError(f"no paper figure against {baseline!r}; baselines: {sorted({f.baseline for f in TRAINING_TIME_FIGURES})}")
    return "; ".join(str(f) for f in figures)


_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Rule:
    """Reproduced iff ``value <op> threshold`` for every seed."""

    op: str
    threshold: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"rule operator must be one of {sorted(_OPS)}, got {self.op!r}")

    def holds(self, value: float) -> bool:
        return _OPS[self.op](value, self.threshold)

    def __str__(self) -> str:
        return f"{self.op} {self.threshold:g}"


@dataclass(frozen=True)
class Measured:
    """Per-seed values (paired across variants) and a line of the underlying figures."""

    values: dict[int, float]
    detail: str


@dataclass(frozen=True)
class NotMeasurable:
    reason: str


Measurement = Measured | NotMeasurable
Rows = Sequence[dict[str, Any]]  # tasks.summary.compare rows, with "per_seed"


def per_seed(rows: Rows, variant: str, key: str) -> dict[int, float | None] | None:
    """``{seed: row figure}`` of ``variant``; None when the variant was not run."""
    for row in rows:
        if row["variant"] == variant:
            return {int(f["seed"]): f.get(key) for f in row.get("per_seed", [])}
    return None


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _ratio(
    num_variant: str, den_variant: str, key: str, what: str, unit: str = "", scale: float = 1.0
) -> Callable[[Rows, float | None], Measurement]:
    """Per seed ``num[key] / den[key]``."""

    def measure(rows: Rows, target: float | None) -> Measurement:
        num, den = per_seed(rows, num_variant, key), per_seed(rows, den_variant, key)
        for v, vals in ((num_variant, num), (den_variant, den)):
            if vals is None:
                return NotMeasurable(f"{v} was not run")
        if key == "time_to_target_s" and target is None:
            return NotMeasurable("no variant improved on the first-step reward, so there is no target")
        seeds = sorted(set(num) & set(den))
        if not seeds:
            return NotMeasurable(f"no seed shared by {num_variant} and {den_variant}")
        for v, vals in ((num_variant, num), (den_variant, den)):
            missing = [s for s in seeds if vals[s] is None]
            if missing:
                return NotMeasurable(
                    f"{v} has no {what} on seed(s) {', '.join(map(str, missing))}" + (" (target not reached)" if key == "time_to_target_s" else "")
                )
            if any(vals[s] <= 0 for s in seeds):
                return NotMeasurable(f"{v}'s {what} is 0 on some seed (below the measurement's resolution)")
        num_mean, den_mean = _mean([num[s] for s in seeds]) * scale, _mean([den[s] for s in seeds]) * scale
        detail = f"{what}: {num_variant} {num_mean:.4g}{unit}, {den_variant} {den_mean:.4g}{unit} (means over seeds)"
        return Measured({s: num[s] / den[s] for s in seeds}, detail)

    return measure


IW_ROUNDING = 1e-3  # a max behaviour IW this close to 1 is rounding (engine vs trainer), not a stale token's weight


def _iw_extremes(rows: Rows, target: float | None) -> Measurement:
    """Per seed max behaviour IW loglinear / recompute, where some weight moved away from 1. Without
    stale tokens both weights are 1 but for rounding, and their ratio (0.9999995 or 1.0000004) would
    decide the claim by noise."""
    ratio = _ratio("loglinear", "recompute", "behav_iw_max", "max behaviour IW")(rows, target)
    if isinstance(ratio, NotMeasurable):
        return ratio
    ll, rc = per_seed(rows, "loglinear", "behav_iw_max"), per_seed(rows, "recompute", "behav_iw_max")
    flat = [s for s in ratio.values if abs(ll[s] - 1) < IW_ROUNDING and abs(rc[s] - 1) < IW_ROUNDING]
    if flat:
        return NotMeasurable(f"max behaviour IW within {IW_ROUNDING:g} of 1 for both variants on seed(s) "
                             f"{', '.join(map(str, flat))}: no stale token moved a weight, nothing to control")
    return ratio


PARITY_SHORTFALL = 0.05  # the shortfall the per-seed reward-parity rule looks for (its threshold, -0.05)


def _reward_gap(rows: Rows, target: float | None) -> Measurement:
    ll, rc = per_seed(rows, "loglinear", "final_reward"), per_seed(rows, "recompute", "final_reward")
    if ll is None or rc is None:
        return NotMeasurable(f"{'loglinear' if ll is None else 'recompute'} was not run")
    seeds = sorted(set(ll) & set(rc))
    if not seeds:
        return NotMeasurable("no seed shared by loglinear and recompute")
    # A shortfall can only be seen where the reference learned at least that much: between arms whose
    # reward did not move, "no shortfall" is what any candidate, broken or not, would show.
    gains = [g for g in (per_seed(rows, "recompute", "reward_gain") or {}).values() if g is not None]
    moved = _mean(gains) if gains else 0.0
    if moved < PARITY_SHORTFALL:
        return NotMeasurable(f"recompute's reward moved {moved:+.3f} from its first steps (mean over seeds), less than "
                             f"the {PARITY_SHORTFALL:g} shortfall the rule looks for: parity between arms that did not "
                             "learn is no evidence of parity")
    return Measured({s: ll[s] - rc[s] for s in seeds},
                    f"final reward: loglinear {_mean([ll[s] for s in seeds]):.3f}, recompute {_mean([rc[s] for s in seeds]):.3f} (means over seeds)")


def _clipped_vs_fewest_other(rows: Rows, target: float | None) -> Measurement:
    ll = per_seed(rows, "loglinear", "clipped_frac")
    others = {r["variant"]: per_seed(rows, r["variant"], "clipped_frac") for r in rows if r["variant"] != "loglinear"}
    if ll is None or not others:
        return NotMeasurable("loglinear was not run" if ll is None else "no other variant to compare with")
    seeds = sorted(set(ll).intersection(*others.values()))
    if not seeds:
        return NotMeasurable("no seed shared by all variants")
    if any(v is None for vals in (ll, *others.values()) for v in (vals[s] for s in seeds)):
        return NotMeasurable("a run has no clipped-token metric (stability/trust_ratio_clipped_frac)")
    if all(vals[s] == 0 for vals in (ll, *others.values()) for s in seeds):
        return NotMeasurable("no variant clipped any token")
    detail = "clipped tokens: " + ", ".join(f"{v} {_mean([vals[s] for s in seeds]):.2e}" for v, vals in {"loglinear": ll, **others}.items())
    return Measured({s: ll[s] - min(vals[s] for vals in others.values()) for s in seeds}, detail + " (means over seeds)")


@dataclass(frozen=True)
class Claim:
    key: str
    statement: str  # the paper's claim, in words
    paper: str  # the paper's figure, or "qualitative: ..." where none was found
    source: str
    quantity: str  # what the testbed's value is, per seed
    unit: str  # how the value is printed: "x" (ratio), "" (difference)
    measure: Callable[[Rows, float | None], Measurement]
    rule: Rule


CLAIMS: tuple[Claim, ...] = (
    Claim("prox_time", "proximal log-probs without the extra forward pass",
          "~8,500x faster proximal policy computation (~10 s -> ~0.001 s per step)", BLOG,
          "prox time per step, recompute / loglinear", "x",
          _ratio("recompute", "loglinear", "prox_time_s", "prox time per step", " ms", 1e3), Rule(">=", 10.0)),
    Claim("ttt_vs_recompute", "faster training than decoupled PPO with the recomputed proximal policy",
          figures_against("recompute"), f"{PAPER}; {AREAL_DOCS}",
          "wall time to target, recompute / loglinear", "x",
          _ratio("recompute", "loglinear", "time_to_target_s", "time to target", " s"), Rule(">", 1.0)),
    Claim("ttt_vs_sync", "asynchronous training with A-3PO is faster than synchronous training",
          figures_against("sync"), f"{PAPER} v3 abstract; {BLOG}", "wall time to target, sync / loglinear", "x",
          _ratio("sync", "loglinear", "time_to_target_s", "time to target", " s"), Rule(">", 1.0)),
    Claim("reward_parity", "final performance comparable to recompute",
          "qualitative 'comparable performance'; AReaL docs: final task reward 0.937 vs 0.954, eval reward 0.799 vs 0.795",
          f"{PAPER} abstract; {AREAL_DOCS}", "final reward, loglinear - recompute", "",
          _reward_gap, Rule(">=", -0.05)),
    Claim("behav_iw_extremes", "more controlled importance weights (pi_prox / pi_behav)",
          "qualitative: 'better stability with more controlled importance weights'; no figure found", BLOG,
          "max behaviour IW over the run, loglinear / recompute", "x",
          _iw_extremes, Rule("<", 1.0)),
    Claim("clipped_tokens", "A-3PO clips the fewest tokens",
          "qualitative, as we read the paper; no figure found in the abstract, blog or AReaL docs", f"{PAPER} (our reading)",
          "clipped-token fraction, loglinear - fewest of the other variants", "",
          _clipped_vs_fewest_other, Rule("<=", 0.0)),
)


def spread(values: Sequence[float], unit: str = "") -> str:
    """``v`` for one seed; ``mean +- sample std (min..max, n seeds)`` for several."""
    fmt = (lambda v: f"{v:.3g}{unit}") if unit else (lambda v: f"{v:+.3g}")
    if len(values) == 1:
        return f"{fmt(values[0])} (1 seed)"
    return f"{fmt(statistics.mean(values))} +- {statistics.stdev(values):.2g} ({fmt(min(values))}..{fmt(max(values))}, {len(values)} seeds)"


def judge(claim: Claim, m: Measurement) -> tuple[str, str]:
    """``(verdict, one-line reason)`` of ``claim`` on measurement ``m`` (the rule in the module docstring)."""
    if isinstance(m, NotMeasurable):
        return NOT_MEASURABLE, m.reason
    try:
        all_pass((claim.rule.holds(v) for v in m.values.values()), "seed measured")
    except NothingToJudge as e:  # "reproduced on all 0 seeds" would be a verdict on nothing
        return NOT_MEASURABLE, str(e)
    failing = {s: v for s, v in m.values.items() if not claim.rule.holds(v)}
    n = len(m.values)
    if not failing:
        worst = min(m.values.values(), key=lambda v: abs(v - claim.rule.threshold))
        return REPRODUCED, f"{claim.quantity} {claim.rule} on all {n} seed(s) (closest {worst:.3g})"
    seed, value = max(failing.items(), key=lambda kv: abs(kv[1] - claim.rule.threshold))
    return NOT_REPRODUCED, f"{claim.quantity} {claim.rule} fails on {len(failing)} of {n} seed(s) (seed {seed}: {value:.3g})"


def combine(a: str, b: str) -> str:
    """One claim's verdict from its verdicts ``a`` and ``b`` on two disjoint seed sets:

    - ``a == b``: that verdict (reproduced twice, not reproduced twice, not measurable twice);
    - either is "not measurable here": "not measurable here" (one set cannot decide it);
    - otherwise they differ: "not settled", never "reproduced".
    """
    for v in (a, b):
        if v not in VERDICTS:
            raise ValueError(f"a seed set's verdict is one of {VERDICTS}, got {v!r}")
    if NOT_MEASURABLE in (a, b):
        return NOT_MEASURABLE
    return a if a == b else NOT_SETTLED


@dataclass(frozen=True)
class SeedSet:
    """One seed set's comparison: its rows (``tasks.summary.compare``'s, with ``per_seed``) and
    reward target, computed from that set's runs alone."""

    name: str  # "A" (the seeds) or "B" (the replicate seeds)
    seeds: tuple[int, ...]
    rows: Rows
    target: float | None
    parity: ParityResult | None = None  # the calibrated shortfall test of this set's runs, where a calibration covers them


def seed_set(name: str, records: Sequence[dict[str, Any]], seeds: Sequence[int], target_fraction: float,
             smooth_frac: float, parity: ParityResult | None = None) -> SeedSet:
    """The comparison of the runs on ``seeds`` only (``records``: a flow's, with ``seed`` and
    ``history_path``). The target is this set's own, so the other set's runs move none of its
    figures: each set is judged as if it had been the only run. ``parity``: the calibrated shortfall
    test of these runs where a calibration covers them (it judges reward parity)."""
    chosen = [ArmRun.of({**r, "history": read_history(r["history_path"])}) for r in records if r["seed"] in seeds]
    comp = compare(chosen, target_fraction, smooth_frac)
    return SeedSet(name, tuple(seeds), comp.rows, comp.target, parity)


def rows_by_placement(rows: Rows) -> dict[str, list[dict[str, Any]]]:
    """The comparison's rows per placement (a3po.config.axes.PLACEMENTS), each named by its arm
    without the placement and the staleness bound (the claims' arms share the comparison's bound), so a
    claim compares variants that generated in the same place."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        arm = Arm.parse(row["variant"])
        bare = arm.model_copy(update={"placement": None, "staleness_control": None, "max_staleness": None})
        groups.setdefault(arm.placement or "colocated", []).append({**row, "variant": bare.name})
    return groups


def check_claims(rows: Rows, target: float | None, claims: Sequence[Claim] = CLAIMS,
                 parity: ParityResult | None = None) -> list[dict[str, Any]]:
    """One result per claim and placement: paper figure, testbed figure with spread, verdict and
    reason. Results of a placement other than colocated carry it in their key (``ttt_vs_sync_on_disaggregated``).
    ``parity``: the calibrated shortfall test of these runs, which judges reward parity where it
    covers the placement's arms (the calibrations are of the colocated arms: :data:`tasks.parity.CALIBRATED_ARMS`)."""
    groups = rows_by_placement(rows)
    if not groups:
        raise NothingToJudge("no comparison rows for the claims: every claim compares variants that ran")
    out = []
    for placement, group in groups.items():
        suffix = "" if placement == "colocated" else f"_on_{placement}"
        out += [{**r, "claim": r["claim"] + suffix, "placement": placement}
                for r in _check(group, target, claims, parity if placement == "colocated" else None)]
    return out


def judge_calibrated(parity: ParityResult) -> tuple[str, str]:
    """``(verdict, reason)`` of reward parity by the calibrated shortfall test: reproduced iff it passes."""
    line = -parity.tolerance
    return (REPRODUCED if parity.passed else NOT_REPRODUCED,
            f"calibrated shortfall rule (tasks.parity; the per-seed -0.05 is tiny's): {parity.candidate} - {', '.join(parity.pooled)} pooled, "
            f"mean {parity.mean_diff:+.3f} over {len(parity.seeds)} seed(s) {'>=' if parity.passed else '<'} the FAIL line {line:+.3f} "
            f"(healthy mean {parity.healthy_mean:+.4f}, sd {parity.noise_sd:.4f})")


def _check(rows: Rows, target: float | None, claims: Sequence[Claim], parity: ParityResult | None = None) -> list[dict[str, Any]]:
    out = []
    for c in claims:
        m = c.measure(rows, target)
        calibrated = c.key == "reward_parity" and parity is not None and isinstance(m, Measured)
        verdict, reason = judge_calibrated(parity) if calibrated else judge(c, m)
        measured = isinstance(m, Measured)
        out.append({
            "claim": c.key, "statement": c.statement, "paper": c.paper, "source": c.source, "quantity": c.quantity,
            "rule": "calibrated shortfall (tasks.parity)" if calibrated else str(c.rule),
            "testbed": spread(list(m.values.values()), c.unit) + f"; {m.detail}" if measured else "-",
            "values": {str(s): v for s, v in m.values.items()} if measured else {},
            "verdict": verdict, "reason": reason,
        })
    return out


def check_sets(sets: Sequence[SeedSet], claims: Sequence[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """The claims on one or two seed sets. One: :func:`check_claims`'s results as they are. Two:
    one result per claim (and placement) with each set's figure, verdict and reason in ``sets``
    (in order) and ``verdict`` the two verdicts combined (:func:`combine`)."""
    if len(sets) not in (1, 2):
        raise ValueError(f"claims are judged on one seed set or on two (a replication), got {len(sets)}")
    judged = [{r["claim"]: r for r in check_claims(s.rows, s.target, claims, s.parity)} for s in sets]
    if len(sets) == 1:
        return list(judged[0].values())
    out = []
    for key in dict.fromkeys(k for by_claim in judged for k in by_claim):
        per_set = []
        for s, by_claim in zip(sets, judged, strict=True):
            r = by_claim.get(key, {"testbed": "-", "values": {}, "verdict": NOT_MEASURABLE, "reason": f"no runs of it on set {s.name}"})
            per_set.append({"set": s.name, "seeds": list(s.seeds), "target": s.target,
                            **{k: r[k] for k in ("testbed", "values", "verdict", "reason")}})
        first = next(by_claim[key] for by_claim in judged if key in by_claim)
        verdicts = [p["verdict"] for p in per_set]
        out.append({**{k: first[k] for k in ("claim", "statement", "paper", "source", "quantity", "rule", "placement")},
                    "sets": per_set, "verdict": combine(*verdicts),
                    "reason": "; ".join(f"set {s.name}: {v}" for s, v in zip(sets, verdicts, strict=True))})
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row_md(cells: Sequence[str]) -> str:
    return "| " + " | ".join(_cell(x) for x in cells) + " |"


def claims_markdown(results: Sequence[dict[str, Any]]) -> str:
    """The claims table: one set's figure, verdict and reason, or two sets side by side with
    the combined verdict (results of :func:`check_sets`)."""
    replicated = any("sets" in r for r in results)
    if replicated:
        a, b = (f"set {p['set']} (seeds {', '.join(map(str, p['seeds']))})" for p in results[0]["sets"])
        lines = [f"| claim | paper | {a} | verdict A | {b} | verdict B | combined |", "|---|---|---|---|---|---|---|"]
        lines += [_row_md([f"{r['statement']} ({r['claim']})", r["paper"],
                           *(x for p in r["sets"] for x in (p["testbed"], f"**{p['verdict']}**: {p['reason']}")), f"**{r['verdict']}**"])
                  for r in results]
    else:  # the combined column says a single set's verdict is not replicated, so none reads as settled
        lines = ["| claim | paper | this testbed | verdict | reason | combined |", "|---|---|---|---|---|---|"]
        lines += [_row_md([f"{r['statement']} ({r['claim']})", r["paper"], r["testbed"], f"**{r['verdict']}**", r["reason"],
                           NOT_MEASURABLE if r["verdict"] == NOT_MEASURABLE else NOT_REPLICATED]) for r in results]
    lines += ["", "Sources of the paper's figures:", ""] + list(dict.fromkeys(f"- {r['claim']}: {r['source']}" for r in results))
    lines += ["", "Rule (tasks/claims.py): reproduced iff the value passes its threshold on every seed; "
              "not measurable here when the quantity does not exist in this run. Reward parity, where a calibration covers the "
              "runs: the calibrated shortfall rule (its reason says so)."]
    if replicated:
        lines.append("Each claim is judged on each seed set alone (its runs, its own reward target). Combined: the same verdict on both "
                     f"sets stands; {NOT_MEASURABLE} when either set cannot measure it; {NOT_SETTLED} when the sets disagree.")
    else:
        lines.append("One seed set: no verdict here is replicated; --replicate-seeds judges every claim again on a second, disjoint set.")
    return "\n".join(lines) + "\n"


def claims_metrics(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``claims/<key>/reproduced`` (1 or 0; absent when not measurable) and ``claims/reproduced``
    (the count) of each claim's verdict, the combined one when two sets were judged. One set:
    ``claims/<key>/mean`` of its values. Two: ``claims/<key>/set_a|set_b/reproduced|mean`` per set
    and ``claims/not_settled`` (the count)."""
    m: dict[str, float] = {}
    for r in results:
        key = f"claims/{r['claim']}"
        if r["verdict"] != NOT_MEASURABLE:
            m[f"{key}/reproduced"] = float(r["verdict"] == REPRODUCED)
            if "sets" not in r:
                m[f"{key}/mean"] = _mean(list(r["values"].values()))
        for p in r.get("sets", []):
            if p["verdict"] != NOT_MEASURABLE:
                m[f"{key}/set_{p['set'].lower()}/reproduced"] = float(p["verdict"] == REPRODUCED)
                m[f"{key}/set_{p['set'].lower()}/mean"] = _mean(list(p["values"].values()))
    m["claims/reproduced"] = float(sum(r["verdict"] == REPRODUCED for r in results))
    if any("sets" in r for r in results):
        m["claims/not_settled"] = float(sum(r["verdict"] == NOT_SETTLED for r in results))
    return {k: v for k, v in m.items() if math.isfinite(v)}


@task(cache_policy=NO_CACHE)
def report_claims(sets: Sequence[SeedSet], out_dir: str, header: str) -> dict[str, Any]:
    """Judge the claims on one seed set's comparison or on two (:func:`check_sets`); write
    claims.md (``header`` first) and claims.json to ``out_dir``."""
    results = check_sets(sets)
    md = claims_markdown(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "claims.md").write_text(f"{header}\n\n{md}")
    targets = {"target": sets[0].target} if len(sets) == 1 else {"targets": {s.name: s.target for s in sets}}
    (out / "claims.json").write_text(json.dumps({"results": results, **targets}, indent=1))
    return {"results": results, "markdown": md, "metrics": claims_metrics(results), "artifacts": [str(out / "claims.md"), str(out / "claims.json")]}

