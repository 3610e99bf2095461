"""Pairs: each arm against each of its baselines (:func:`tasks.summary.baselines_of`), paired by seed,
with 95% intervals, so that a few seeds are not read as a verdict.

Per pair (arm A, baseline B), over the K seeds both ran (same warm start, prompt stream and sampler
seed: the runs are paired):

- **speed ratios** ``r_s = x_B,s / x_A,s`` for ``x`` = time to target and mean step time (rollout
  wait + update); ``r > 1``: A is faster. With ``l_s = ln r_s``, ``m = mean(l)`` and ``sd(l)`` the
  sample standard deviation (K - 1 in the denominator), the figure is the geometric mean ``exp(m)``
  and its interval ``exp(m -+ t_{0.975, K-1} sd(l) / sqrt(K))`` (Student's t on the log ratios: a
  ratio's noise is multiplicative). A seed where either side never reached the target has no
  time-to-target ratio: each figure says how many seeds entered it.
- **reward difference** ``d_s = final reward A - final reward B`` (:func:`tasks.summary.final_reward`);
  ``mean(d) -+ t_{0.975, K-1} sd(d) / sqrt(K)``.
- One seed: the figure alone, "1 seed: no interval" (one run says nothing of the spread).

Verdicts come from the interval, never from the point: a speed figure is **faster** if its low end
is > 1, **slower** if its high end is < 1, else **not settled**; one seed is always "not settled
(1 seed)". The reward difference is judged only where a calibration says how far a healthy arm
sits from its references: the calibrated shortfall rule (:func:`tasks.parity.decide`, rule
``shortfall``) for ``loglinear`` against ``recompute`` and ``sync`` pooled, at a (preset, steps) of
:data:`tasks.parity.CALIBRATIONS` run as shipped. Elsewhere the interval is reported with "no
calibration for <preset> at <steps> steps", never a pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.arms import Arm, metric_key_part
from tasks.parity import CALIBRATED_ARMS, CALIBRATIONS, POOLED, Calibration, ParityResult, decide
from tasks.summary import SMOOTH_FRAC, arm_of, baselines_of

CONFIDENCE = 0.95  # two-sided, the intervals' coverage
ONE_SEED = "1 seed: no interval"
UNCALIBRATED_PAIR = "no calibration for this pair (interval only)"


@dataclass(frozen=True)
class Interval:
    """A figure over the ``n`` seeds that entered it: ``point`` (None when ``n == 0``) and its
    interval (None with fewer than two seeds)."""

    n: int
    point: float | None = None
    low: float | None = None
    high: float | None = None


def t_quantile(k: int, confidence: float = CONFIDENCE) -> float:
    """``t_{(1 + confidence) / 2, k - 1}``: the two-sided Student's t quantile for ``k`` seeds
    (``t_{0.975, 2}`` = 4.303)."""
    from scipy.stats import t as student_t  # the pipeline extra; imported where used, as tasks.parity does

    return float(student_t.ppf((1 + confidence) / 2, k - 1))


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """``mean(v) -+ t_{(1 + c) / 2, K-1} sd(v) / sqrt(K)`` over the K values (sd with K - 1 in the
    denominator); the mean alone for K = 1."""
    k = len(values)
    if k == 0:
        return Interval(0)
    mean = sum(values) / k
    if k == 1:
        return Interval(1, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1))
    h = t_quantile(k, confidence) * sd / math.sqrt(k)
    return Interval(k, mean, mean - h, mean + h)


def ratio_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The geometric mean of positive ``ratios`` and its interval: :func:`mean_interval` of
    ``ln r``, mapped back by ``exp``."""
    logs = mean_interval([math.log(r) for r in ratios], confidence)
    return Interval(logs.n, *(None if v is None else math.exp(v) for v in (logs.point, logs.low, logs.high)))


def speed_verdict(ratio: Interval) -> str:
    """From the interval of a ratio baseline / arm: "faster" (low end > 1), "slower" (high end < 1),
    else "not settled"; one seed is "not settled (1 seed)", none is "-"."""
    if ratio.n == 0:
        return "-"
    if ratio.low is None or ratio.high is None:
        return "not settled (1 seed)"
    return "faster" if ratio.low > 1 else "slower" if ratio.high < 1 else "not settled"


@dataclass(frozen=True)
class Pair:
    """One arm against one baseline over the seeds both ran."""

    arm: str
    baseline: str
    seeds: list[int]  # the seeds both ran
    step_time: Interval  # ratio baseline / arm of the mean step time
    ttt: Interval  # ratio baseline / arm of the time to target (seeds where both reached it)
    reward: Interval  # arm - baseline, final reward
    reward_verdict: str
    pooled: tuple[str, ...] = ()  # the references a pooled baseline (tasks.parity.POOLED) averages
    passed: bool | None = None  # the calibrated shortfall verdict where it covers the pair; None: no calibration

    @property
    def label(self) -> str:
        return f"{self.arm} vs {self.baseline}" + (f" ({', '.join(self.pooled)})" if self.pooled else "")


def paired(arm_seeds: Sequence[dict[str, Any]], base_seeds: Sequence[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(seeds, step-time ratios, time-to-target ratios, reward differences)`` of two rows' per-seed
    figures (:func:`tasks.summary.run_figures` with ``seed``), over the seeds both ran. A ratio needs
    both times > 0 (a time to target is None where the run never reached the target)."""
    theirs = {f["seed"]: f for f in base_seeds}
    both = sorted(((f["seed"], f, theirs[f["seed"]]) for f in arm_seeds if f["seed"] in theirs), key=lambda x: x[0])

    def ratios(key: str) -> list[float]:
        return [b[key] / a[key] for _, a, b in both if a.get(key) and b.get(key) and a[key] > 0 and b[key] > 0]

    diffs = [a["final_reward"] - b["final_reward"] for _, a, b in both if math.isfinite(a["final_reward"] - b["final_reward"])]
    return [s for s, _, _ in both], ratios("mean_step_time_s"), ratios("time_to_target_s"), diffs


@dataclass(frozen=True)
class Setting:
    """What a recorded calibration is tied to, besides the arms: the preset, the RL steps, the
    final reward's window, and whether the preset ran as shipped."""

    preset: str
    steps: int
    smooth_frac: float = SMOOTH_FRAC
    changed: tuple[str, ...] = ()  # what the comparison laid over the preset (config, overrides, model, dataset, task)

    @property
    def uncalibrated(self) -> str:
        return f"no calibration for {self.preset} at {self.steps} steps"


def calibration_of(setting: Setting) -> tuple[Calibration | None, str]:
    """``(calibration, why none)``: the recorded calibration of the setting, or None and a line
    saying why (none recorded, the preset changed, another final-reward window)."""
    found = CALIBRATIONS.get((setting.preset, setting.steps))
    recorded = ", ".join(f"{p} at {s} steps" for p, s in sorted(CALIBRATIONS))
    if found is None:
        return None, f"{setting.uncalibrated} (recorded: {recorded}; bench.nightly_power measures one)"
    if setting.changed:
        return None, f"{setting.uncalibrated} as changed by {list(setting.changed)} (the recorded ones are of the presets as shipped)"
    if setting.smooth_frac != SMOOTH_FRAC:
        return None, f"{setting.uncalibrated} with smooth_frac {setting.smooth_frac} (recorded with {SMOOTH_FRAC})"
    return found, ""


def calibrated_shortfall(records: Sequence[dict[str, Any]], setting: Setting) -> tuple[ParityResult | None, str]:
    """``(result, note)``: the calibrated shortfall test of the calibrated candidate against its
    pooled references (:data:`tasks.parity.CALIBRATED_ARMS`) where the setting has a calibration and
    the comparison ran those arms on shared seeds; else None. ``note`` says which and why."""
    cal, why = calibration_of(setting)
    if cal is None:
        return None, why
    candidate, references, metric = CALIBRATED_ARMS
    have = {arm_of(r) for r in records}
    if candidate not in have or not set(references) <= have:
        return None, (f"{setting.uncalibrated} for these arms (the recorded calibration is of {candidate} against {', '.join(references)} "
                      f"pooled, and this comparison ran {sorted(have)})")
    try:
        (result,) = decide(records, candidate, list(references), metric, smooth_frac=setting.smooth_frac, rule="shortfall",
                           noise_sd=cal.noise_sd, healthy_mean=cal.healthy_mean, calibration_seeds=cal.seeds)
    except ValueError as e:  # no seed every arm ran
        return None, f"{setting.uncalibrated} for these runs ({e})"
    shared = cal.shared_with(result.seeds)
    sample = (f"IN SAMPLE: seeds {shared} are calibration seeds (their noise is in the threshold: passes more often)" if shared
              else "out of sample")
    return result, (f"reward of {candidate} judged by the calibrated shortfall rule (tasks.parity) against {', '.join(references)} pooled "
                    f"(healthy mean {cal.healthy_mean:+.4f}, sd {cal.noise_sd:.4f} on {cal.seeds} seeds: {cal.command}); the pooled row's "
                    f"interval is the test's mean -+ h, FAIL iff the mean is below healthy mean - h = {-result.tolerance:+.4f}; {sample}")


def judged(result: ParityResult, pooled_row: bool = True) -> str:
    """The calibrated shortfall verdict, as the pooled pair reads it or a pair it covers."""
    word = "pass" if result.passed else "FAIL"
    return f"{word} (calibrated shortfall)" if pooled_row else f"{word} (calibrated shortfall vs {', '.join(result.pooled)} pooled)"


def pairs(rows: Sequence[dict[str, Any]], setting: Setting, shortfall: ParityResult | None = None) -> list[Pair]:
    """Every arm of ``rows`` (:func:`tasks.summary.compare`'s, with ``per_seed``) against each of
    its baselines in the comparison, then the calibrated shortfall test as its own pair against the
    pooled references when there is one: its interval is the test's (``mean -+ h``,
    :func:`tasks.parity.shortfall_test`). A pair the shortfall test covers reads its verdict."""
    index = {row["variant"]: row for row in rows}
    out = []
    for row in rows:
        for base in baselines_of(Arm.parse(row["variant"])):
            if base.name == row["variant"] or base.name not in index:
                continue
            seeds, step, ttt, diffs = paired(row.get("per_seed", []), index[base.name].get("per_seed", []))
            covered = shortfall is not None and row["variant"] == shortfall.candidate and base.name in shortfall.pooled
            # A calibration of other arms says nothing of this pair's reward.
            verdict = judged(shortfall, pooled_row=False) if covered else setting.uncalibrated if shortfall is None else UNCALIBRATED_PAIR
            out.append(Pair(row["variant"], base.name, seeds, ratio_interval(step), ratio_interval(ttt), mean_interval(diffs), verdict,
                            passed=shortfall.passed if covered else None))
    if shortfall is not None:
        out.append(Pair(shortfall.candidate, POOLED, list(shortfall.seeds), Interval(0), Interval(0),
                        Interval(len(shortfall.seeds), *map(float, (shortfall.mean_diff, shortfall.ci_low, shortfall.ci_high))), judged(shortfall),
                        tuple(shortfall.pooled), shortfall.passed))
    return out


def pair_metrics(found: Sequence[Pair], prefix: str = "pairs") -> dict[str, float]:
    """``<prefix>/<arm>_vs_<baseline>/{step_time_ratio, ttt_ratio, reward_diff}`` with ``_lo`` and
    ``_hi`` where there is an interval, and ``seeds`` and ``ttt_seeds`` (the seeds each entered);
    the pooled pair (``..._vs_pooled``) has the reward figures and ``reward_pass`` (1: pass)."""
    m: dict[str, float] = {}
    for p in found:
        tag = f"{prefix}/{metric_key_part(p.arm)}_vs_{metric_key_part(p.baseline)}"
        for name, iv in (("step_time_ratio", p.step_time), ("ttt_ratio", p.ttt), ("reward_diff", p.reward)):
            m.update({f"{tag}/{name}{end}": v for end, v in (("", iv.point), ("_lo", iv.low), ("_hi", iv.high)) if v is not None})
        m[f"{tag}/seeds"] = float(len(p.seeds))
        if p.pooled:
            m[f"{tag}/reward_pass"] = float(bool(p.passed))
        else:
            m[f"{tag}/ttt_seeds"] = float(p.ttt.n)
    return m


def _cell(iv: Interval, fmt: str) -> str:
    if iv.point is None:
        return "-"
    if iv.low is None or iv.high is None:
        return f"{iv.point:{fmt}} ({ONE_SEED})"
    return f"{iv.point:{fmt}} [{iv.low:{fmt}}, {iv.high:{fmt}}]"


def pairs_markdown(found: Sequence[Pair], notes: Sequence[str] = ()) -> str:
    """The pairs table, how to read it, and ``notes`` (the reward rule in force)."""
    lines = ["| arm vs baseline | seeds | step-time ratio [lo, hi] | verdict | time-to-target ratio [lo, hi] (n seeds) | verdict | "
             "reward diff [lo, hi] | verdict |", "|" + "---|" * 8]
    for p in found:
        ttt = "-" if p.pooled else f"{_cell(p.ttt, '.3f')} ({p.ttt.n} of {len(p.seeds)} seeds)"
        lines.append(f"| {p.label} | {len(p.seeds)} | {_cell(p.step_time, '.3f')} | {speed_verdict(p.step_time)} | {ttt} | "
                     f"{speed_verdict(p.ttt)} | {_cell(p.reward, '+.3f')} | {p.reward_verdict} |")
    if not found:
        lines.append("| (no arm with a baseline in this comparison) | - | - | - | - | - | - | - |")
    lines += ["", f"Ratios are baseline / arm (> 1: the arm is faster), the geometric mean over the paired seeds with a {CONFIDENCE:.0%} "
              "interval from Student's t on the log ratios; reward diff is arm - baseline of the final reward, mean and "
              f"{CONFIDENCE:.0%} t interval. Speed verdicts come from the interval: faster if its low end is > 1, slower if its high "
              "end is < 1, else not settled (one seed: never settled). A seed where either arm missed the target has no "
              "time-to-target ratio."]
    return "\n".join([*lines, *(f"\nNote: {n}" for n in notes if n)]) + "\n"


@task(cache_policy=NO_CACHE)
def summarise_pairs(summary: dict[str, Any], records: list[dict[str, Any]], setting: Setting, out_dir: str) -> dict[str, Any]:
    """Write pairs.md beside comparison.md (``out_dir``); return ``summary``
    (:func:`tasks.summary.summarise`'s) with ``pairs``, ``pairs_md``, the pairs' metrics and the
    artifact added. ``records`` carry ``history_path`` (the shortfall test reads the histories)."""
    shortfall, note = calibrated_shortfall(records, setting)
    found = pairs(summary["rows"], setting, shortfall)
    md = pairs_markdown(found, [note])
    out = Path(out_dir)
    (out / "pairs.md").write_text(md)
    full = {**summary, "pairs": [asdict(p) for p in found], "pairs_md": md, "metrics": {**summary["metrics"], **pair_metrics(found)}}
    # summary.json (tasks.summary.summarise) holds the pairs too: one file has every figure of the comparison.
    (out / "summary.json").write_text(json.dumps({k: v for k, v in full.items() if k != "artifacts"}, indent=1, default=str))
    artifacts = list(dict.fromkeys([*summary["artifacts"], str(out / "pairs.md"), str(out / "summary.json")]))
    return {**full, "artifacts": artifacts}


NO_CALIBRATION = "no calibration"
SETS_DIFFER = "not settled (the sets differ)"


@dataclass(frozen=True)
class SetPairs:
    """One seed set's pairs (:func:`pairs` of that set's rows) and the note of its reward rule."""

    name: str
    seeds: tuple[int, ...]
    pairs: list[Pair]
    note: str


def set_pairs(name: str, seeds: Sequence[int], rows: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]],
              setting: Setting) -> SetPairs:
    """The pairs of one seed set: ``rows`` are that set's comparison (its own target:
    :func:`tasks.claims.seed_set`), the calibrated test reads that set's ``records`` only."""
    shortfall, note = calibrated_shortfall([r for r in records if r["seed"] in seeds], setting)
    return SetPairs(name, tuple(seeds), pairs(rows, setting, shortfall), note)


def figure_verdicts(p: Pair) -> dict[str, tuple[str, str]]:
    """``figure -> (cell, verdict)`` of one pair: the speed ratios judged by their interval, the
    reward by the calibrated rule where it covers the pair, else "no calibration"."""
    reward = NO_CALIBRATION if p.passed is None else "pass" if p.passed else "FAIL"
    cells = {"reward diff": (_cell(p.reward, "+.3f"), reward)}
    if not p.pooled:
        cells = {"step-time ratio": (_cell(p.step_time, ".3f"), speed_verdict(p.step_time)),
                 "time-to-target ratio": (f"{_cell(p.ttt, '.3f')} ({p.ttt.n} of {len(p.seeds)})", speed_verdict(p.ttt)), **cells}
    return cells


def agree(a: str, b: str) -> str:
    """One figure's verdict from its verdicts on two disjoint seed sets: the same twice stands
    (faster twice, pass twice, not settled twice); any two different ones are "not settled (the
    sets differ)", never the better of the two."""
    return a if a == b else SETS_DIFFER


def replicated_markdown(sets: Sequence[SetPairs]) -> str:
    """The pairs of two seed sets side by side, one line per pair and figure, with the verdict
    both give (:func:`agree`); then each set's note."""
    a, b = sets
    head = [f"| arm vs baseline | figure | set {a.name} (seeds {', '.join(map(str, a.seeds))}) | verdict {a.name} | "
            f"set {b.name} (seeds {', '.join(map(str, b.seeds))}) | verdict {b.name} | both sets |", "|" + "---|" * 7]
    theirs = {p.label: p for p in b.pairs}
    lines = []
    for p in a.pairs:
        q = theirs.get(p.label)
        if q is None:  # an arm that ran on one set only: nothing to replicate
            continue
        mine, other = figure_verdicts(p), figure_verdicts(q)
        for figure, (cell, verdict) in mine.items():
            cell_b, verdict_b = other[figure]
            lines.append(f"| {p.label} | {figure} | {cell} | {verdict} | {cell_b} | {verdict_b} | {agree(verdict, verdict_b)} |")
    if not lines:
        lines.append("| (no pair ran on both sets) | - | - | - | - | - | - |")
    notes = [f"Note (set {s.name}): {s.note}" for s in sets if s.note]
    return "\n".join([*head, *lines, "", "Each set's figures come from its runs alone (its own reward target); intervals and "
                      "verdict words as in pairs.md. A verdict stands only where both sets give it.", *notes]) + "\n"


@task(cache_policy=NO_CACHE)
def summarise_replicated_pairs(sets: list[tuple[str, tuple[int, ...], list[dict[str, Any]]]], records: list[dict[str, Any]],
                               setting: Setting, out_dir: str) -> dict[str, Any]:
    """The pairs of two disjoint seed sets (``(name, seeds, rows)`` each) side by side: write
    pairs_by_set.md to ``out_dir``; return its ``markdown``, ``metrics``
    (``pairs_set_<name>/...``: :func:`pair_metrics` per set) and ``artifacts``."""
    if len(sets) != 2:
        raise ValueError(f"replicated pairs compare two seed sets, got {len(sets)}")
    judged = [set_pairs(name, seeds, rows, records, setting) for name, seeds, rows in sets]
    md = replicated_markdown(judged)
    path = Path(out_dir) / "pairs_by_set.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(md)
    metrics = {k: v for s in judged for k, v in pair_metrics(s.pairs, f"pairs_set_{s.name}").items()}
    return {"markdown": md, "metrics": metrics, "artifacts": [str(path)]}
