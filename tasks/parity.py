"""Convergence parity: is the candidate variant (loglinear) no worse than each reference
(recompute, sync), beyond a tolerance, across seeds? Candidate and references are arms
(tasks.arms), so the same rule compares OPPO on with OPPO off (``loglinear+oppo-inter`` vs
``loglinear``).

The rule (a paired non-inferiority test):

1. For every seed s the candidate and the reference share the warm start, the prompt stream and
   the sampler seed, so their runs are paired. Per seed, ``d_s = m(candidate, s) - m(reference, s)``
   where ``m`` is the run's metric (default ``final_reward``: mean training reward over the last
   ``smooth_frac`` of steps; or ``final_acc``: final held-out accuracy).
2. Paired bootstrap: resample the seeds with replacement ``n_boot`` times (fixed RNG seed, so
   the decision is reproducible) and take the mean of ``d`` each time; the ``confidence``
   percentile interval of those means is the CI of the mean difference.
3. **Pass** iff the CI's lower bound is above ``-tolerance`` for every reference.

With K seeds the bootstrap distribution has at most C(2K-1, K) atoms; for K = 3 the 95% lower
bound lies at or near the smallest ``d_s``, so the rule is conservative (a pass needs every
seed, more or less, within tolerance). A regression larger than the tolerance on most seeds
fails; run-to-run noise smaller than the tolerance passes. ``tolerance`` is in the metric's
units (reward and accuracy: absolute, 0..1).

The ``shortfall`` rule (:func:`shortfall_test`), chosen by the power analysis of recorded runs
(``bench.nightly_power``, docs/pipeline.md): a one-sided test of tonight's candidate against the
candidate as it was when healthy. The references' per-seed mean is one pooled reference (their
noise averages, and one test instead of one per reference keeps the false alarms at alpha),
``d_s = m(candidate, s) - mean_r m(r, s)``. A healthy candidate is not exactly its references:
N recorded seeds give the healthy ``d``'s mean ``mu_h`` (e.g. loglinear a little behind sync)
and its seed-to-seed standard deviation ``sigma``. **Fail** iff
``mean(d) < mu_h - t_{confidence, N-1} * sigma * sqrt(1/K + 1/N)`` (tonight's K seeds against
the N recorded ones, Student's t for the estimated sigma: the calibration's own error is in the
threshold): false alarms at ``1 - confidence`` for a healthy candidate; against a true shortfall
``delta`` the power is about ``Phi(delta / (sigma sqrt(1/K + 1/N)) - t_{confidence, N-1})``. ``mu_h`` and ``sigma`` hold for the setting
they were measured at (preset, steps, candidate, references, metric): :data:`CALIBRATIONS`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.arms import metric_key_part
from tasks.summary import SMOOTH_FRAC, arm_of, final_reward, read_history, start_reward
from tasks.verdicts import NothingToJudge, all_pass

METRICS = ("final_reward", "final_acc")
RULES = ("noninferiority", "shortfall")
POOLED = "pooled"  # the shortfall rule's one reference: the per-seed mean of the references


@dataclass(frozen=True)
class ParityResult:
    candidate: str
    reference: str
    metric: str
    seeds: list[int]
    diffs: list[float]  # candidate - reference, per seed
    mean_diff: float
    ci_low: float
    ci_high: float
    tolerance: float  # largest acceptable shortfall; the shortfall rule's is t * sigma * sqrt(1/K + 1/N) - mu_h
    confidence: float
    passed: bool
    rule: str = "noninferiority"
    noise_sd: float | None = None  # the shortfall rule's sigma
    pooled: tuple[str, ...] = ()  # the references a pooled reference averages
    healthy_mean: float | None = None  # the shortfall rule's mu_h
    calibration_seeds: int | None = None  # the seeds mu_h and sigma were measured on (N)


@dataclass(frozen=True)
class Calibration:
    """The healthy candidate's pooled differences at one setting, from recorded runs."""

    healthy_mean: float  # mu_h
    noise_sd: float  # sigma
    measured_on: tuple[int, ...]  # the seeds that measured them
    command: str  # how they were measured

    @property
    def seeds(self) -> int:
        """N, the number of calibration seeds (the t quantile's N - 1 degrees of freedom)."""
        return len(self.measured_on)

    def shared_with(self, seeds: Sequence[int]) -> list[int]:
        """The given seeds the calibration was measured on: a night on them is judged in sample
        (its own noise is part of the threshold it is held to, and passes more often)."""
        return sorted(set(seeds) & set(self.measured_on))


# Measured by bench.nightly_power (docs/results.md, "Nightly power"); the shortfall rule's
# defaults where the nightly runs these settings: (preset, RL steps) with candidate loglinear,
# references recompute and sync, metric final_reward (smooth_frac 0.25). The nightly's budget is
# calibrated on seeds 10-19, none of the nightly's (NIGHTLY_SEEDS), and was checked on nights drawn
# from seeds 0-9 held out of it; the 150-step one (a budget no deployment runs) on seeds 0-9, so a
# night on seeds 0-5 at 150 steps is judged in sample, and its rule's note says so. The pretrained
# preset at its 10 steps (bf16 where the CPU has it, 16 samples a step) on seeds 10-14, none of the
# nightly's: its seed noise is five times tiny's at 75 steps, so at K = 3 seeds the rule detects a
# 0.12 shortfall with 80% power (docs/results.md, "Reward parity on smol").
CALIBRATIONS: dict[tuple[str, int], Calibration] = {
    ("tiny", 75): Calibration(healthy_mean=-0.0083, noise_sd=0.0104, measured_on=tuple(range(10, 20)),
                              command="python -m bench.nightly_power --steps 75 --seeds 10-19 --holdout-seeds 0-9"),
    ("tiny", 150): Calibration(healthy_mean=-0.0125, noise_sd=0.0322, measured_on=tuple(range(10)),
                               command="python -m bench.nightly_power --steps 150 --seeds 0-9"),
    ("smol", 10): Calibration(healthy_mean=-0.0333, noise_sd=0.0558, measured_on=tuple(range(10, 15)),
                              command="python -m bench.nightly_power --preset smol --steps 10 --seeds 10-14"),
}
CALIBRATED_ARMS = ("loglinear", ("recompute", "sync"), "final_reward")

# The nightly's RL steps per preset where no steps are given: the budget the calibration above was
# measured at. Six seeds at half of the preset's 150 steps cost what three seeds at 150 did, and
# catch a 0.05 shortfall with >= 97% power where three at 150 reach 53-70%: the seed noise of
# the final reward at 75 steps is about half of that at 150 (docs/results.md, "Nightly power").
NIGHTLY_STEPS: dict[str, int] = {"tiny": 75}
NIGHTLY_SEEDS = (0, 1, 2, 3, 4, 5)


def calibration_for(preset: str, steps: int, candidate: str, references: Sequence[str], metric: str) -> Calibration:
    """The recorded calibration of this setting; raises naming how to measure one."""
    found = CALIBRATIONS.get((preset, steps))
    if found is None or (candidate, tuple(sorted(references)), metric) != CALIBRATED_ARMS:
        raise ValueError(f"no recorded calibration for preset {preset!r} at {steps} steps with candidate {candidate!r}, references "
                         f"{list(references)}, metric {metric!r} (recorded: {sorted(CALIBRATIONS)} for loglinear vs recompute, sync on "
                         f"final_reward): measure one with python -m bench.nightly_power --preset {preset} --steps {steps}, then "
                         "pass noise_sd and healthy_mean")
    return found


def paired_bootstrap_ci(diffs: Sequence[float], n_boot: int = 10_000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: percentile interval of the mean of ``diffs`` resampled with replacement."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        raise ValueError("no paired differences")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(d.mean()), float(low), float(high)


def shortfall_test(diffs: Sequence[float], noise_sd: float, confidence: float = 0.95, healthy_mean: float = 0.0,
                   calibration_seeds: int | None = None) -> tuple[float, float, float, float, bool]:
    """``(mean, low, high, tolerance, passed)`` of the one-sided test of "no shortfall against the
    healthy candidate": ``mean = (1/K) sum_s d_s``, ``h = q * sigma * sqrt(1/K + 1/N)``,
    ``[low, high] = mean -+ h``; **fail** iff ``mean < mu_h - h`` (``tolerance = h - mu_h``, the
    largest shortfall that passes). ``N`` is the number of seeds ``mu_h`` and ``sigma`` were
    measured on (``calibration_seeds``) and ``q`` Student's t quantile at ``confidence`` with
    ``N - 1`` degrees of freedom: under ``d ~ N(mu_h, sigma^2)`` the statistic
    ``(mean - mu_h_hat) / (sigma_hat sqrt(1/K + 1/N))`` is t-distributed with ``N - 1`` degrees
    (tonight's mean, the calibration's mean and its sd are independent), so a healthy candidate
    fails with probability ``1 - confidence``, the calibration's own error included. With
    ``calibration_seeds=None`` ``mu_h`` and ``sigma`` are taken as exact: ``q`` is the normal
    quantile ``z`` and the ``1/N`` term is dropped. Against a true shortfall ``delta`` the power is
    about ``Phi(delta / (sigma sqrt(1/K + 1/N)) - q)``."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        raise ValueError("no paired differences")
    if not noise_sd > 0 or not 0.5 < confidence < 1:
        raise ValueError(f"the shortfall rule needs noise_sd > 0 and confidence in (0.5, 1), got {noise_sd} and {confidence}")
    if calibration_seeds is None:
        q, spread = NormalDist().inv_cdf(confidence), np.sqrt(1 / d.size)
    elif calibration_seeds >= 2:
        from scipy.stats import t as student_t

        q, spread = float(student_t.ppf(confidence, calibration_seeds - 1)), np.sqrt(1 / d.size + 1 / calibration_seeds)
    else:
        raise ValueError(f"calibration_seeds must be >= 2 (the seeds healthy_mean and noise_sd were measured on), got {calibration_seeds}")
    h = q * noise_sd * spread
    mean = float(d.mean())
    return mean, mean - h, mean + h, float(h - healthy_mean), bool(mean >= healthy_mean - h)


def check_references(candidate: str, references: Sequence[str]) -> None:
    """A parity verdict needs a reference other than the candidate, each named once: raises
    naming what is missing or repeated (an arm compared with itself differs by 0 on every seed,
    and would pass whatever the arm does)."""
    if not references:
        raise NothingToJudge(f"no references to compare the candidate {candidate!r} with")
    if candidate in references:
        raise ValueError(f"the candidate {candidate!r} is also a reference: an arm compared with itself passes whatever it does")
    repeated = sorted({r for r in references if list(references).count(r) > 1})
    if repeated:
        raise ValueError(f"references repeat {repeated}: each reference is one comparison")


def run_metric(record: dict[str, Any], metric: str, smooth_frac: float = SMOOTH_FRAC) -> float:
    if metric == "final_reward":
        history = record.get("history") or read_history(record["history_path"])
        return final_reward(history, smooth_frac)
    if metric == "final_acc":
        return float(record["final_acc"])
    raise ValueError(f"unknown parity metric {metric!r}; valid: {METRICS}")


# How far the references' training reward must rise (mean over seeds) for parity to be judged: between
# arms that did not learn, "no shortfall" is what any candidate, broken or not, would show.
MIN_REFERENCE_GAIN = 0.05


def references_moved(records: Sequence[dict[str, Any]], references: Sequence[str],
                     smooth_frac: float = SMOOTH_FRAC) -> str | None:
    """Why parity cannot be judged on ``records``, or None when it can: the mean over the
    references' runs of ``final_reward - start_reward`` (the first and last ``smooth_frac`` of
    steps, :mod:`tasks.summary`) is below :data:`MIN_REFERENCE_GAIN`."""
    gains = []
    for r in records:
        if arm_of(r) in references:
            history = r.get("history") or read_history(r["history_path"])
            gains.append(final_reward(history, smooth_frac) - start_reward(history, smooth_frac))
    moved = float(np.mean(gains)) if gains else 0.0
    if moved >= MIN_REFERENCE_GAIN:
        return None
    return (f"the references ({', '.join(references)}) moved their reward {round(moved, 3) + 0.0:+.3f} from their first steps (mean "
            f"over {len(gains)} run(s)), less than {MIN_REFERENCE_GAIN:g}: parity between arms that did not learn is no "
            "evidence of parity (a candidate that learned nothing would pass)")


def decide(
    records: Sequence[dict[str, Any]],
    candidate: str,
    references: Sequence[str],
    metric: str = "final_reward",
    tolerance: float = 0.1,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    smooth_frac: float = SMOOTH_FRAC,
    rule: str = "noninferiority",
    noise_sd: float | None = None,
    healthy_mean: float = 0.0,
    calibration_seeds: int | None = None,
) -> list[ParityResult]:
    """``noninferiority``: one :class:`ParityResult` per reference, over the seeds both arms ran;
    ``shortfall``: one against the pooled references, over the seeds every arm ran."""
    check_references(candidate, references)
    values: dict[str, dict[int, float]] = {}
    for r in records:
        values.setdefault(arm_of(r), {})[int(r["seed"])] = run_metric(r, metric, smooth_frac)
    if candidate not in values:
        raise ValueError(f"candidate {candidate!r} has no runs")
    if rule == "shortfall":
        if noise_sd is None:
            raise ValueError("the shortfall rule needs noise_sd: the seed-to-seed sd of the pooled differences (bench.nightly_power)")
        seeds = sorted(set(values[candidate]).intersection(*(values.get(ref, {}) for ref in references)))
        if not seeds:
            raise ValueError(f"no seeds shared by {candidate!r} and every reference of {list(references)}")
        diffs = [values[candidate][s] - float(np.mean([values[ref][s] for ref in references])) for s in seeds]
        mean, low, high, tolerance, passed = shortfall_test(diffs, noise_sd, confidence, healthy_mean, calibration_seeds)
        return [ParityResult(candidate, POOLED, metric, seeds, diffs, mean, low, high, tolerance, confidence, passed,
                             rule, noise_sd, tuple(references), healthy_mean, calibration_seeds)]
    if rule != "noninferiority":
        raise ValueError(f"unknown parity rule {rule!r}; valid: {RULES}")
    out = []
    for ref in references:
        seeds = sorted(set(values[candidate]) & set(values.get(ref, {})))
        if not seeds:
            raise ValueError(f"no seeds shared by {candidate!r} and {ref!r}")
        diffs = [values[candidate][s] - values[ref][s] for s in seeds]
        mean, low, high = paired_bootstrap_ci(diffs, n_boot, confidence)
        out.append(ParityResult(candidate, ref, metric, seeds, diffs, mean, low, high, tolerance, confidence, low > -tolerance))
    return out


def parity_metrics(results: Sequence[ParityResult]) -> dict[str, float]:
    m: dict[str, float] = {}
    for r in results:
        tag = f"parity/{metric_key_part(r.candidate)}_vs_{metric_key_part(r.reference)}"
        m.update({f"{tag}/mean_diff": r.mean_diff, f"{tag}/ci_low": r.ci_low, f"{tag}/ci_high": r.ci_high, f"{tag}/pass": float(r.passed)})
    m["parity/pass"] = float(all_pass((r.passed for r in results), "parity results"))
    return m


def report_markdown(results: Sequence[ParityResult], trend: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| candidate vs reference | metric | seeds | per-seed diff | mean | CI low | CI high | tolerance | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        against = f"{r.reference}({', '.join(r.pooled)})" if r.pooled else r.reference
        lines.append(
            f"| {r.candidate} vs {against} | {r.metric} | {len(r.seeds)} | {', '.join(f'{d:+.3f}' for d in r.diffs)} | "
            f"{r.mean_diff:+.3f} | {r.ci_low:+.3f} | {r.ci_high:+.3f} | {r.tolerance:.3f} | {'pass' if r.passed else 'FAIL'} |"
        )
    if trend:
        lines += [
            "",
            "Earlier nightly runs (newest first):",
            "",
            "| started | parity | " + " | ".join(f"CI low vs {r.reference}" for r in results) + " |",
            "|---|---|" + "---|" * len(results),
        ]
        for t in trend:
            lows = [t["ci_low"].get(r.reference) for r in results]
            lines.append(f"| {t['start']} | {t['parity']} | " + " | ".join("-" if v is None else f"{v:+.3f}" for v in lows) + " |")
    return "\n".join(lines) + "\n"


def trend_verdict(results: Sequence[ParityResult], trend: Sequence[dict[str, Any]]) -> str:
    """One line: how tonight's CI lower bounds compare with the median of earlier nights."""
    if not trend:
        return "no earlier nightly runs to compare with"
    parts = []
    for r in results:
        past = [t["ci_low"][r.reference] for t in trend if t["ci_low"].get(r.reference) is not None]
        if not past:
            continue
        med = float(np.median(past))
        word = "better" if r.ci_low > med + 0.01 else "worse" if r.ci_low < med - 0.01 else "about the same"
        parts.append(f"vs {r.reference}: CI low {r.ci_low:+.3f} against a median of {med:+.3f} over {len(past)} earlier night(s) ({word})")
    fails = sum(t["parity"] == "fail" for t in trend)
    return "; ".join(parts) + f"; {fails} of {len(trend)} earlier night(s) failed"


@task(cache_policy=NO_CACHE)
def decide_parity(
    records: list[dict[str, Any]],
    candidate: str,
    references: list[str],
    metric: str,
    tolerance: float,
    confidence: float,
    n_boot: int,
    smooth_frac: float,
    rule: str = "noninferiority",
    noise_sd: float | None = None,
    healthy_mean: float = 0.0,
    calibration_seeds: int | None = None,
) -> list[dict[str, Any]]:
    """The parity decision (per reference, or against the pooled references), as plain dicts."""
    return [asdict(r) for r in decide(records, candidate, references, metric, tolerance, confidence, n_boot, smooth_frac, rule, noise_sd,
                                      healthy_mean, calibration_seeds)]


@task(cache_policy=NO_CACHE)
def earlier_nights(
    tracking_uri: str, experiment_id: str, current_run_id: str, candidate: str, references: list[str], n: int = 14
) -> list[dict[str, Any]]:
    """Earlier nightly parent runs of the experiment with the same candidate that reached a
    verdict (tag ``parity``), newest first, with their CI lower bounds."""
    from tasks.tracking import client_for

    client = client_for(tracking_uri)
    # Same candidate only: an OPPO parity night (loglinear+oppo-inter) is not a variant night's trend.
    query = f"tags.`a3po.kind` = 'nightly' and tags.parity != '' and tags.`a3po.candidate` = '{candidate}'"
    runs = client.search_runs([experiment_id], query, max_results=n + 1, order_by=["attributes.start_time DESC"])
    out = []
    for run in runs:
        if run.info.run_id == current_run_id:
            continue
        m = run.data.metrics
        out.append({
            "run_id": run.info.run_id,
            "start": np.datetime64(run.info.start_time, "ms").astype(str)[:19],
            "parity": run.data.tags.get("parity"),
            "ci_low": {ref: m.get(f"parity/{metric_key_part(candidate)}_vs_{metric_key_part(ref)}/ci_low") for ref in references},
        })
    return out[:n]
