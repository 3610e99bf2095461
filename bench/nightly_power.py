"""Power of the nightly verdict, from recorded runs: which rule catches a 0.05 shortfall?

The nightly (``flows.nightly_parity``) trains the candidate (loglinear) and the references
(recompute, sync) on K seeds and decides from the per-seed paired differences of the final
smoothed reward. Whether a rule catches a regression of a given size, and how often it cries
wolf, depends on the seed-to-seed noise of those differences at the nightly budget: this
measures it. It runs (or reuses) ``a3po train`` per steps x arm x seed under ``--runs-dir``
(``steps<S>/<variant>-seed<s>``; planted candidates in ``steps<S>-<plant>/``,
:mod:`bench._planted`), then reports:

1. the noise: per steps budget, the paired differences' mean and standard deviation against
   each reference and against the references' mean (the pooled reference);
2. the power table: per rule x steps x K seeds x effect size, the probability of a fail
   verdict; effect 0 is the false-alarm rate. Two estimates: *resampled* (every K-subset of the
   recorded seeds, the candidate's figures shifted down by the effect: no model of the noise)
   and *normal* (20,000 draws from the fitted normal of the per-seed differences: smooth in K);
3. the cost: the measured RL wall per run and the nightly's wall for K seeds;
4. the planted regressions' own shortfall and verdicts, where recorded;
5. with ``--holdout-seeds``, the verdicts out of sample: the shortfall rule calibrated on
   ``--seeds`` only, then every K-subset of the held-out seeds judged as a night (the false-alarm
   rate and the power with no seed shared between calibration and night), the nightly's own
   seeds (:data:`tasks.parity.NIGHTLY_SEEDS`) as one night, and the planted runs against that
   calibration. Give the nightly's seeds as held out: a calibration that contains them judges
   its own seeds, which is how an in-sample pass looks good.

Rules (:data:`tasks.parity.RULES`): ``noninferiority`` (the paired bootstrap against each
reference with a tolerance, the nightly's original rule) and ``shortfall`` (a one-sided test of
the mean difference to the pooled reference against the healthy candidate's, with the mean and
standard deviation measured here on N seeds: fail iff
``mean(d) < mu_h - t_{1-alpha, N-1} sigma sqrt(1/K + 1/N)``).

    python -m bench.nightly_power --runs-dir runs/power --seeds 0-9 --steps 150,75            # run what is missing, report
    python -m bench.nightly_power --runs-dir runs/power --seeds 0-5 --steps 150 --plants lr_half,biased_advantage
    python -m bench.nightly_power --runs-dir runs/power --report-only
    python -m bench.nightly_power --runs-dir runs/power --steps 75 --seeds 10-19 --holdout-seeds 0-9 \
        --plants lr_half,biased_advantage --plant-seeds 0-5       # calibrate on 10-19, judge nights of 0-9

Prints the tables, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np

CANDIDATE, REFERENCES = "loglinear", ("recompute", "sync")
EFFECTS = (0.0, 0.03, 0.05, 0.1)
ALPHA = 0.05


def parse_seeds(text: str) -> list[int]:
    """``0-9`` or ``0,1,2``."""
    if "-" in text and "," not in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def run_folder(runs: Path, steps: int, plant: str | None) -> Path:
    return runs / (f"steps{steps}" if plant is None else f"steps{steps}-{plant}")


def collect(runs: Path, preset: str, steps: int, seeds: list[int], plant: str | None, config: str | None = None) -> None:
    """Train what is missing: every arm on every seed (a plant: the candidate only). Planted
    folders share the healthy folder's warm start (same config up to the candidate's rl)."""
    out = run_folder(runs, steps, plant)
    out.mkdir(parents=True, exist_ok=True)
    if plant is not None and not (out / "cache").exists():
        (out / "cache").symlink_to(Path("..") / run_folder(runs, steps, None).name / "cache")
        (run_folder(runs, steps, None) / "cache").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true"}
    for seed in seeds:
        for variant in (CANDIDATE,) if plant else (CANDIDATE, *REFERENCES):
            if (out / f"{variant}-seed{seed}" / "result.json").exists():
                continue
            train = ["--variant", variant, "--seed", str(seed), "--steps", str(steps), "--preset", preset,
                     "--output-dir", str(out), "--no-progress", *(["--config", config] if config else [])]
            cmd = ([sys.executable, "-m", "bench._planted", plant, "--", "train", *train] if plant
                   else [sys.executable, "-m", "a3po.training.command", *train])
            print(f"train {out.name}/{variant}-seed{seed}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def load(runs: Path, steps: int, plant: str | None) -> dict[str, dict[int, dict[str, float]]]:
    """``{variant: {seed: {final_reward, rl_wall_s}}}`` of the finished runs in a folder."""
    from tasks.summary import final_reward, read_history

    found: dict[str, dict[int, dict[str, float]]] = {}
    for result in sorted(run_folder(runs, steps, plant).glob("*-seed*/result.json")):
        variant, seed = result.parent.name.rsplit("-seed", 1)
        summary = json.loads(result.read_text())
        found.setdefault(variant, {})[int(seed)] = {
            "final_reward": final_reward(read_history(result.parent / "metrics.jsonl")),
            "rl_wall_s": float(summary["wall_s"]),
        }
    return found


def paired(values: dict[str, dict[int, dict[str, float]]], candidate: dict[int, dict[str, float]] | None = None,
           among: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """Seeds every arm ran (of ``among``, where given) and the (K, 2) per-seed differences
    candidate - each reference."""
    cand = values.get(CANDIDATE, {}) if candidate is None else candidate
    seeds = sorted(set(cand).intersection(*(values.get(r, {}) for r in REFERENCES)).intersection(among if among is not None else cand))
    d = np.array([[cand[s]["final_reward"] - values[r][s]["final_reward"] for r in REFERENCES] for s in seeds]).reshape(-1, len(REFERENCES))
    return seeds, d


def verdict_fails(rule: str, d: np.ndarray, healthy: tuple[float, float, int], tolerance: float) -> bool:
    """The rule's verdict on one night's (K, 2) differences (True = fail); ``healthy`` is the
    shortfall rule's calibration ``(mu_h, sigma, N)`` of the pooled differences."""
    from tasks.parity import paired_bootstrap_ci, shortfall_test

    if rule == "noninferiority":  # the nightly's defaults: 95% interval, fail iff its low end <= -tolerance
        return any(paired_bootstrap_ci(d[:, j], n_boot=2000, confidence=0.95)[1] <= -tolerance for j in range(d.shape[1]))
    if rule == "shortfall":
        return not shortfall_test(d.mean(axis=1), healthy[1], 1 - ALPHA, healthy[0], healthy[2])[4]
    raise KeyError(rule)


def calibrate(d: np.ndarray) -> tuple[float, float, int]:
    """``(mu_h, sigma, N)`` of the pooled differences of N healthy seeds."""
    pooled = d.mean(axis=1)
    return float(pooled.mean()), float(pooled.std(ddof=1)), len(pooled)


def nights(n: int, k: int, cap: int) -> list[tuple[int, ...]]:
    """Every K-subset of ``n`` recorded seeds (indices) as a night, at most ``cap`` of them, evenly spread."""
    subsets = list(itertools.combinations(range(n), k))
    if len(subsets) > cap:
        subsets = [subsets[i] for i in np.linspace(0, len(subsets) - 1, cap).astype(int)]
    return subsets


def fail_rate_resampled(rule: str, d: np.ndarray, k: int, effect: float, tolerance: float, cap: int = 300) -> float:
    """Every K-subset of the recorded seeds (at most ``cap``, evenly spread) as a night, the
    candidate shifted down by ``effect``; the shortfall rule calibrated on the other seeds only
    (at least 3), so the estimate is out of sample."""
    fails = []
    for s in nights(len(d), k, cap):
        rest = np.delete(d, list(s), axis=0)
        fails.append(verdict_fails(rule, d[list(s)] - effect, calibrate(rest), tolerance))
    return float(np.mean(fails))


def fail_rate_held_out(rule: str, calibration: np.ndarray, held_out: np.ndarray, k: int, effect: float, tolerance: float,
                       cap: int = 300) -> tuple[float, int]:
    """``(fail rate, nights)``: every K-subset of the held-out seeds' differences (at most ``cap``,
    evenly spread) judged as a night, the candidate shifted down by ``effect``, the shortfall rule
    calibrated on ``calibration`` alone: no seed is both calibration and night. The nights share
    seeds with each other, so the rate is an average over overlapping nights, not independent ones."""
    subsets = nights(len(held_out), k, cap)
    healthy = calibrate(calibration)
    return float(np.mean([verdict_fails(rule, held_out[list(s)] - effect, healthy, tolerance) for s in subsets])), len(subsets)


def fail_rate_normal(rule: str, d: np.ndarray, k: int, effect: float, tolerance: float, draws: int) -> float:
    """Draws of K seeds from the normal fitted to the per-seed difference pairs, shifted down by
    ``effect``. The shortfall rule is calibrated, per draw, on as many healthy seeds as were
    recorded, drawn from the same normal: the calibration's own error is part of the estimate,
    as it is of a deployed nightly's."""
    rng = np.random.default_rng(0)
    mean, cov = d.mean(axis=0), np.cov(d, rowvar=False)
    nights = rng.multivariate_normal(mean - effect, cov, size=(draws, k))
    if rule == "shortfall":  # vectorised, with the rule's own threshold
        from tasks.parity import shortfall_test

        calib = rng.multivariate_normal(mean, cov, size=(draws, len(d))).mean(axis=2)
        mu, sigma = calib.mean(axis=1), calib.std(axis=1, ddof=1)
        unit = shortfall_test([0.0] * k, 1.0, 1 - ALPHA, 0.0, len(d))[3]  # z sqrt(1/K + 1/N) for sigma = 1
        return float(np.mean(nights.mean(axis=2).mean(axis=1) < mu - unit * sigma))
    return float(np.mean([verdict_fails(rule, n, calibrate(d), tolerance) for n in nights[: min(draws, 2000)]]))


def detectable_shortfall(sigma: float, n: int, k: int, power: float = 0.8, alpha: float = ALPHA) -> float:
    """The smallest true shortfall the shortfall rule calibrated on ``n`` seeds (noise ``sigma``)
    fails with probability ``power`` on a night of ``k`` seeds:
    ``(t_{1 - alpha, n - 1} + z_power) * sigma * sqrt(1/k + 1/n)``."""
    from scipy.stats import t as student_t

    return float((student_t.ppf(1 - alpha, n - 1) + NormalDist().inv_cdf(power)) * sigma * np.sqrt(1 / k + 1 / n))


def report_held_out(runs: Path, noise: dict[int, dict], held_out: list[int], ks: list[int], tolerance: float,
                    effects: tuple[float, ...] = EFFECTS) -> dict[str, object]:
    """Print and return the verdicts on held-out seeds against the calibration on the others: the
    fail rate per rule x K x effect over every K-subset of the held-out seeds, and the nightly's
    own seeds as one healthy night."""
    from tasks.parity import NIGHTLY_SEEDS

    out: dict[str, object] = {}
    for steps, nz in noise.items():
        kept, d = paired(load(runs, steps, None), among=held_out)
        if len(kept) < 2:
            print(f"\nsteps {steps}: fewer than 2 held-out seeds recorded ({kept}): no out-of-sample verdicts")
            continue
        mu, sigma, n = calibrate(nz["d"])
        pooled = d.mean(axis=1)
        print(f"\nOut of sample, steps {steps}: calibrated on seeds {nz['seeds']} (healthy_mean {mu:+.4f}, noise_sd {sigma:.4f}); "
              f"nights drawn from the held-out seeds {kept} (pooled difference mean {pooled.mean():+.4f}, sd {pooled.std(ddof=1):.4f}). "
              "Probability of a FAIL verdict (effect 0 = false alarm), over every K-subset of the held-out seeds:\n")
        print("| rule | K | nights | " + " | ".join(f"effect {e:.2f}" for e in effects) + " |")
        print("|---|---|---|" + "---|" * len(effects))
        rows = []
        for rule in ("noninferiority", "shortfall"):
            for k in (k for k in ks if k <= len(kept)):
                rates = {e: fail_rate_held_out(rule, nz["d"], d, k, e, tolerance) for e in effects}
                nights = next(iter(rates.values()))[1]
                rows.append({"rule": rule, "k": k, "nights": nights, **{f"fail@{e:.2f}": round(r, 3) for e, (r, _) in rates.items()}})
                print(f"| {rule} | {k} | {nights} | " + " | ".join(f"{r:.2f}" for r, _ in rates.values()) + " |")
        night = {}
        if set(NIGHTLY_SEEDS) <= set(kept):
            idx = [kept.index(s) for s in NIGHTLY_SEEDS]
            night = {rule: "fail" if verdict_fails(rule, d[idx], (mu, sigma, n), tolerance) else "pass" for rule in ("noninferiority", "shortfall")}
            print(f"\nthe nightly's seeds {list(NIGHTLY_SEEDS)} as one healthy night (out of sample): pooled difference "
                  f"{d[idx].mean():+.4f}; verdicts: " + ", ".join(f"{r} {v}" for r, v in night.items()))
        out[str(steps)] = {"calibration_seeds": nz["seeds"], "held_out_seeds": kept, "healthy_mean": round(mu, 4), "noise_sd": round(sigma, 4),
                           "held_out_mean": round(float(pooled.mean()), 4), "held_out_sd": round(float(pooled.std(ddof=1)), 4),
                           "fail_rates": rows, "nightly_seeds_night": night}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nightly_power", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", default="runs/power")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--config", default=None, help="YAML over the preset for every run (e.g. thread counts: torch_threads: 1)")
    ap.add_argument("--steps", default="150", help="comma-separated RL step budgets")
    ap.add_argument("--seeds", default="0-9", help="0-9 or 0,1,2")
    ap.add_argument("--plants", default="", help="comma-separated planted regressions to run on the candidate (bench._planted)")
    ap.add_argument("--plant-seeds", default=None, help="seeds of the planted runs (default: --seeds)")
    ap.add_argument("--ks", default="3,4,5,6,8", help="K seeds per night to evaluate")
    ap.add_argument("--effects", default=",".join(f"{e:g}" for e in EFFECTS),
                    help="comma-separated shortfalls to plant in the power tables, 0 = false alarms (default %(default)s)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="the noninferiority rule's tolerance")
    ap.add_argument("--draws", type=int, default=20_000)
    ap.add_argument("--holdout-seeds", default=None, help="seeds judged as nights against the calibration on --seeds alone (disjoint from it)")
    ap.add_argument("--report-only", action="store_true", help="use the recorded runs, train nothing")
    args = ap.parse_args(argv)
    runs, seeds = Path(args.runs_dir), parse_seeds(args.seeds)
    held_out = parse_seeds(args.holdout_seeds) if args.holdout_seeds else []
    if set(held_out) & set(seeds):
        ap.error(f"--holdout-seeds {held_out} share {sorted(set(held_out) & set(seeds))} with --seeds {seeds}: a held-out night "
                 "must not be part of the calibration")
    try:
        effects = tuple(float(e) for e in args.effects.split(",") if e.strip())
    except ValueError:
        ap.error(f"--effects: comma-separated numbers, got {args.effects!r}")
    if not effects or min(effects) < 0:
        ap.error(f"--effects: one or more shortfalls >= 0, got {args.effects!r}")
    budgets = [int(s) for s in args.steps.split(",")]
    plants = [p for p in args.plants.split(",") if p]
    plant_seeds = parse_seeds(args.plant_seeds) if args.plant_seeds else seeds
    if not args.report_only:
        for steps in budgets:
            collect(runs, args.preset, steps, seeds + held_out, None, args.config)
            for plant in plants:
                collect(runs, args.preset, steps, plant_seeds, plant, args.config)

    from tasks.parity import shortfall_test

    figures: dict[str, object] = {"alpha": ALPHA, "budgets": {}}
    print(f"Noise of the per-seed paired differences (final smoothed reward, {CANDIDATE} - reference):\n")
    print("| steps | seeds | vs recompute mean / sd | vs sync mean / sd | vs pooled mean / sd | RL wall per run (s) |")
    print("|---|---|---|---|---|---|")
    noise = {}
    for steps in budgets:
        values = load(runs, steps, None)
        kept, d = paired(values, among=seeds)  # the calibration's seeds only: held-out seeds are judged below
        if len(kept) < 3:
            print(f"| {steps} | {len(kept)} | (fewer than 3 seeds recorded) | | | |")
            continue
        pooled = d.mean(axis=1)
        walls = {v: float(np.median([values[v][s]["rl_wall_s"] for s in kept])) for v in (CANDIDATE, *REFERENCES)}
        noise[steps] = {"d": d, "sigma": float(pooled.std(ddof=1)), "walls": walls, "seeds": kept}
        print(f"| {steps} | {len(kept)} | {d[:, 0].mean():+.4f} / {d[:, 0].std(ddof=1):.4f} | {d[:, 1].mean():+.4f} / {d[:, 1].std(ddof=1):.4f} | "
              f"{pooled.mean():+.4f} / {pooled.std(ddof=1):.4f} | " + ", ".join(f"{v} {w:.0f}" for v, w in walls.items()) + " |")
        figures["budgets"][str(steps)] = {"seeds": len(kept), "sigma_pooled": round(noise[steps]["sigma"], 4),
                                          "mean_pooled": round(float(pooled.mean()), 4),
                                          "sd_vs": {r: round(float(d[:, j].std(ddof=1)), 4) for j, r in enumerate(REFERENCES)},
                                          "rl_wall_s": {v: round(w, 1) for v, w in walls.items()}}

    ks = [int(k) for k in args.ks.split(",")]
    print("\nProbability of a FAIL verdict (effect 0 = false alarm), resampled seeds / normal model:\n")
    print("| rule | steps | K | nightly wall (s) | " + " | ".join(f"effect {e:.2f}" for e in effects) + " |")
    print("|---|---|---|---|" + "---|" * len(effects))
    power: list[dict] = []
    for rule in ("noninferiority", "shortfall"):
        for steps, nz in noise.items():
            for k in ks:
                wall = k * sum(nz["walls"].values())
                cells, row = [], {"rule": rule, "steps": steps, "k": k, "nightly_wall_s": round(wall)}
                for e in effects:
                    rs = fail_rate_resampled(rule, nz["d"], k, e, args.tolerance) if k <= len(nz["d"]) - 3 else float("nan")
                    nm = fail_rate_normal(rule, nz["d"], k, e, args.tolerance, args.draws)
                    cells.append(f"{'-' if np.isnan(rs) else f'{rs:.2f}'} / {nm:.2f}")
                    row[f"fail@{e:.2f}"] = {"resampled": None if np.isnan(rs) else round(rs, 3), "normal": round(nm, 3)}
                power.append(row)
                print(f"| {rule} | {steps} | {k} | {wall:.0f} | " + " | ".join(cells) + " |")
    figures["power"] = power
    for steps, nz in noise.items():
        mu, sigma, n = calibrate(nz["d"])
        # 0.05 caught with 80% power: 0.05 >= (t + z_0.8) sigma sqrt(1/K + 1/N), t the rule's quantile
        # (Student's, N - 1 degrees); none if N calibration seeds cannot allow it.
        t = shortfall_test([0.0, 0.0], 1.0, 1 - ALPHA, 0.0, n)[3] / np.sqrt(1 / 2 + 1 / n)
        room = (0.05 / ((t + NormalDist().inv_cdf(0.8)) * sigma)) ** 2 - 1 / n
        k_needed = int(np.ceil(1 / room)) if room > 0 else None
        detectable = {k: round(detectable_shortfall(sigma, n, k), 4) for k in ks}
        figures["budgets"][str(steps)].update({"k_for_0.05_at_80pct": k_needed, "healthy_mean": round(mu, 4), "noise_sd": round(sigma, 4),
                                               "calibration_seeds": n, "detectable_at_80pct": detectable})
        print(f"\nsteps {steps}: calibration of the shortfall rule: healthy_mean {mu:+.4f}, noise_sd {sigma:.4f} ({n} seeds); "
              + (f"K >= {k_needed} seed(s) detect 0.05" if k_needed else f"no K detects 0.05 on {n} calibration seeds")
              + f" with 80% power at {ALPHA:.0%} false alarms; tolerance at K seeds: "
              f"{-mu:+.4f} + {t:.3f} x {sigma:.4f} x sqrt(1/K + 1/{n}); the shortfall detected with 80% power at K seeds: "
              + ", ".join(f"K = {k}: {v:.3f}" for k, v in detectable.items()))

    planted = {}
    for steps, nz in noise.items():
        for plant in plants or [p.name.split("-", 1)[1] for p in runs.glob(f"steps{steps}-*")]:
            healthy = load(runs, steps, None)
            cand = load(runs, steps, plant).get(CANDIDATE, {})
            kept, d = paired(healthy, cand)
            if not kept:
                continue
            pooled = d.mean(axis=1)
            short = [cand[s]["final_reward"] - healthy[CANDIDATE][s]["final_reward"] for s in kept]
            verdicts = {rule: "fail" if verdict_fails(rule, d, calibrate(nz["d"]), args.tolerance) else "pass"
                        for rule in ("noninferiority", "shortfall")}
            sample = "in sample" if set(kept) & set(nz["seeds"]) else "out of sample"  # against the calibration's seeds
            planted[f"{plant}@{steps}"] = {"seeds": kept, "shortfall_vs_healthy": [round(x, 4) for x in short],
                                           "mean_vs_pooled": round(float(pooled.mean()), 4), "calibration": sample, **verdicts}
            print(f"\nplanted {plant} (steps {steps}, seeds {kept}, {sample}): vs the healthy candidate {np.mean(short):+.4f} "
                  f"({', '.join(f'{x:+.3f}' for x in short)}); vs pooled {pooled.mean():+.4f}; verdicts: "
                  + ", ".join(f"{r} {v}" for r, v in verdicts.items()))
    figures["planted"] = planted
    if held_out:
        figures["out_of_sample"] = report_held_out(runs, noise, held_out, ks, args.tolerance, effects)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
