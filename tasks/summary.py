"""The comparison: per-variant table, speedups, plots.

Definitions (also in docs/pipeline.md):

- **smoothed reward**: trailing mean of ``reward/mean`` over ``W = max(1, ceil(smooth_frac x
  steps))`` steps (``smooth_frac`` = 0.25). **Final reward** = the smoothed reward at the last
  step, i.e. the mean training reward over the last W steps.
- **target reward**: ``r0 + target_fraction x (r_best - r0)`` where ``r0`` is the mean reward of
  the first step (all variants start from the same warm start) and ``r_best`` the best
  variant's final reward (mean over seeds); ``target_fraction`` = 0.8. So the target is "80%
  of the improvement the best variant achieved". Undefined (no speedup reported) when no
  variant improved on ``r0``.
- **time to target**: ``time/train_wall_s`` (trainer wall clock: rollout wait + update, without
  evaluation) at the first step whose smoothed reward reaches the target; a variant's figure is
  the mean over its seeds, reported only when every seed got there.
- **rows** are arms (tasks.arms): a variant, or ``<variant>+oppo-<mode>`` (OPPO on), or with a
  staleness bound (``+s<N>``, ``+adaptive``), compared like variants; an OPPO arm is also compared
  with its variant's OPPO-off row; an asynchronous baseline (recompute) is taken at the row's bound.
- **step time**: the trainer's period per step, rollout wait + update (``perf/wait_time_s +
  perf/step_time_s``): what a step costs the run, whether the trainer waited for generation (sync)
  or generation ran beside it. ``train (s/step)`` is the update alone.
- **speedup of A vs B**: ``T_B / T_A`` for time to target, and ``mean step time_B / mean step
  time_A`` (>1: A is faster). **Deltas**: ``A - B`` of final reward and
  final held-out accuracy.
- **stability columns** (per-step metrics of ``a3po.algorithms.stability``, each over the step's tokens):
  "behaviour IW max" = the largest ``stability/behav_iw_max`` (``pi_prox / pi_behav``, the
  off-policy importance weight A-3PO's stability claim is about) over steps and seeds;
  "behaviour IW p99" = the mean over steps of the step's 99th percentile of it (mean over seeds);
  "trust-region ratio max" = the largest ``stability/trust_ratio_max`` (``pi_theta / pi_prox``,
  what the clip bounds); "clipped tokens" = the mean over steps of the step's fraction of tokens
  whose clipped term is active (mean over seeds). ``row["per_seed"]`` keeps each seed's figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.arms import Arm

SMOOTH_FRAC = 0.25
TARGET_FRACTION = 0.8
BASELINES = ("sync", "recompute")
# The most on-policy asynchronous bound: a looser or adaptive bound of the same arm is weighed against it.
BOUND_BASELINE = 1


def window(steps: int, smooth_frac: float = SMOOTH_FRAC) -> int:
    return max(1, math.ceil(smooth_frac * steps))


def smooth(values: Sequence[float], w: int) -> list[float]:
    """Trailing mean over ``w`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= w:
            acc -= values[i - w]
        out.append(acc / min(i + 1, w))
    return out


def final_reward(history: Sequence[dict[str, float]], smooth_frac: float = SMOOTH_FRAC) -> float:
    rewards = [h["reward/mean"] for h in history]
    return smooth(rewards, window(len(rewards), smooth_frac))[-1] if rewards else float("nan")


def start_reward(history: Sequence[dict[str, float]], smooth_frac: float = SMOOTH_FRAC) -> float:
    """The mean training reward over the first ``smooth_frac`` of steps: where a run started, on the
    same window as :func:`final_reward`, so ``final - start`` is how far its reward moved."""
    rewards = [h["reward/mean"] for h in history]
    w = window(len(rewards), smooth_frac)
    return sum(rewards[:w]) / w if rewards else float("nan")


def time_to_target(history: Sequence[dict[str, float]], target: float, smooth_frac: float = SMOOTH_FRAC) -> float | None:
    rewards = [h["reward/mean"] for h in history]
    for h, r in zip(history, smooth(rewards, window(len(rewards), smooth_frac)), strict=True):
        if r >= target:
            return h["time/train_wall_s"]
    return None


def read_history(path: str | Path) -> list[dict[str, float]]:
    """The rows of a history or metrics JSONL file in order, the lines of one ``step`` merged into
    one row (a background held-out evaluation logs its figures after its step's line)."""
    rows: dict[object, dict[str, float]] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row.get("step", ("line", i)), {}).update(row)
    return list(rows.values())


def _mean(xs: Sequence[float | None]) -> float | None:
    xs = list(xs)
    if not xs or any(x is None for x in xs):
        return None
    return sum(xs) / len(xs)


# Per-run stability figures from the step metrics (a3po.algorithms.stability): key -> (step metric, how the
# steps are combined). Maxima are the run's maximum; the p99 and the clipped fraction are the mean
# over steps of the step's figure (each step's is over its own tokens).
STABILITY_FIGURES = {
    "behav_iw_max": ("stability/behav_iw_max", max),
    "behav_iw_p99": ("stability/behav_iw_p99", lambda v: sum(v) / len(v)),
    "trust_ratio_max": ("stability/trust_ratio_max", max),
    "clipped_frac": ("stability/trust_ratio_clipped_frac", lambda v: sum(v) / len(v)),
}


def run_figures(history: Sequence[dict[str, float]], target: float | None, smooth_frac: float = SMOOTH_FRAC) -> dict[str, float | None]:
    """One run's figures: final reward, time to ``target`` (None: not reached, or no target),
    mean step time, mean proximal log-prob time per step (``prox/time_s``), stability figures
    (:data:`STABILITY_FIGURES`; None when the history lacks the metric)."""
    n = len(history)
    final = final_reward(history, smooth_frac)
    figs: dict[str, float | None] = {
        "final_reward": final,
        "reward_gain": final - start_reward(history, smooth_frac),
        "time_to_target_s": time_to_target(history, target, smooth_frac) if target is not None else None,
        "mean_step_time_s": sum(x["perf/step_time_s"] + x.get("perf/wait_time_s", 0.0) for x in history) / n,
        "prox_time_s": sum(x.get("prox/time_s", 0.0) for x in history) / n,
    }
    for key, (metric, combine) in STABILITY_FIGURES.items():
        values = [x[metric] for x in history if metric in x]
        figs[key] = combine(values) if values else None
    return figs


def arm_of(record: dict[str, Any]) -> str:
    """The record's row: its arm (records written before arms existed name only the variant)."""
    return record.get("arm") or record["variant"]


def baselines_of(arm: Arm) -> list[Arm]:
    """What a row is compared with, in its own placement: sync and recompute, for an OPPO arm
    its variant with OPPO off, and for an asynchronous arm under another bound than
    :data:`BOUND_BASELINE` or an adaptive one, the same arm at that bound (``loglinear+s8`` and
    ``loglinear+adaptive-s8`` against ``loglinear+s1``: what a looser bound buys). An asynchronous
    baseline runs at the row's staleness bound (``loglinear+s4`` against ``recompute+s4``); sync has
    none. A baseline counts where the comparison ran it."""
    bound = {"staleness_control": arm.staleness_control, "max_staleness": arm.max_staleness}
    own = [Arm(variant=arm.variant, **bound)] if arm.oppo not in (None, "off") else []
    bases = [b.model_copy(update=bound) if b.variant.is_async else b for b in (Arm.parse(b) for b in BASELINES)]
    looser = arm.variant.is_async and (arm.adaptive or arm.max_staleness != BOUND_BASELINE)
    tight = [Arm(variant=arm.variant, oppo=arm.oppo, max_staleness=BOUND_BASELINE)] if looser else []
    return list(dict.fromkeys(b.within(arm) for b in [*bases, *own, *tight]))


def _max(xs: Sequence[float | None]) -> float | None:
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else max(xs)


@dataclass
class Comparison:
    rows: list[dict[str, Any]]  # one per variant (means over seeds)
    metrics: dict[str, float]  # parent-run summary metrics (valid MLflow keys)
    target: float | None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ArmRun:
    """One arm x seed as the comparison reads it: a flow's record (tasks.training.RunRecord as a
    dict, plus its evaluation) with its per-step history."""

    arm: Arm  # the row it belongs to (read from the record's name: tasks.arms)
    seed: int
    history: list[dict[str, float]]  # per step: reward/mean, perf/step_time_s, time/train_wall_s, ...
    warmstart_acc: float
    final_acc: float
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the evaluation's eval/final/<bench>/<metric>

    @classmethod
    def of(cls, record: dict[str, Any]) -> ArmRun:
        """From a record dict with ``history`` (read from its ``history_path`` by :func:`summarise`)."""
        return cls(arm=Arm.parse(arm_of(record)), seed=record["seed"], history=record["history"], warmstart_acc=record["warmstart_acc"],
                   final_acc=record["final_acc"], eval_metrics=record.get("evaluation", {}).get("metrics", {}))


def compare(runs: Sequence[ArmRun], target_fraction: float = TARGET_FRACTION, smooth_frac: float = SMOOTH_FRAC) -> Comparison:
    """One row per arm (first-seen order; means over its seeds), the parent run's summary
    metrics, and the reward target (module docstring)."""
    by_arm: dict[Arm, list[ArmRun]] = {}
    for run in runs:
        by_arm.setdefault(run.arm, []).append(run)
    first = [r.history[0]["reward/mean"] for r in runs if r.history]
    r0 = sum(first) / len(first) if first else 0.0
    finals = {arm: _mean([final_reward(r.history, smooth_frac) for r in rs]) for arm, rs in by_arm.items()}
    r_best = max((f for f in finals.values() if f is not None), default=r0)
    target = r0 + target_fraction * (r_best - r0) if r_best > r0 else None
    notes = [] if target is not None else [
        f"no variant improved on the first-step reward {r0:.3f}: time to target and its speedups are undefined"]
    rows = [_row(arm, rs, finals[arm], target, smooth_frac) for arm, rs in by_arm.items()]
    if target is not None:
        notes += _target_reach(rows, target)
    metrics = {f"summary/{arm.metric_key}/{key}": row[key]
               for arm, row in zip(by_arm, rows, strict=True) for key in ROW_METRICS if row[key] is not None}
    metrics.update(_against_baselines(rows, list(by_arm)))
    if target is not None:
        metrics["summary/target_reward"] = target
    metrics["summary/first_step_reward"] = r0
    return Comparison(rows=rows, metrics=metrics, target=target, notes=notes)


def _target_reach(rows: Sequence[dict[str, Any]], target: float) -> list[str]:
    """One line where some run did not reach ``target``: how many did, and which did not (an arm
    with such a seed has no mean time to target: it is shown, not averaged over the others). Some
    run always does: the target is below the best arm's mean final reward, so below one of its
    seeds' final reward, which that seed's smoothed curve reaches at its last step."""
    runs = [(row["variant"], f["seed"], f["time_to_target_s"]) for row in rows for f in row["per_seed"]]
    missed = [f"{arm} seed {seed}" for arm, seed, t in runs if t is None]
    if not missed:
        return []
    return [f"the target reward {target:.3f} was reached by {len(runs) - len(missed)} of {len(runs)} runs; not reached: "
            + ", ".join(missed)]


ROW_METRICS = ("final_reward", "final_acc", "time_to_target_s", "mean_step_time_s", "train_wall_s", "mean_generate_s", "mean_train_s",
               "mean_idle_s", *STABILITY_FIGURES)


def _row(arm: Arm, runs: Sequence[ArmRun], final: float | None, target: float | None, smooth_frac: float) -> dict[str, Any]:
    """One arm's row: means over its seeds (maxima for the ``*_max`` stability figures), each
    seed's figures in ``per_seed``, benchmark metrics ``eval/final/<bench>/<metric>``."""
    hist = [r.history for r in runs if r.history]
    per_seed = [{"seed": r.seed, **run_figures(r.history, target, smooth_frac)} for r in runs if r.history]
    row = {
        "variant": arm.name,
        "placement": arm.placement or "colocated",
        "seeds": len(runs),
        "warmstart_acc": _mean([r.warmstart_acc for r in runs]),
        "final_acc": _mean([r.final_acc for r in runs]),
        "final_reward": final,
        "time_to_target_s": _mean([f["time_to_target_s"] for f in per_seed]) if target is not None else None,
        "mean_step_time_s": _mean([f["mean_step_time_s"] for f in per_seed]),
        "train_wall_s": _mean([h[-1]["time/train_wall_s"] for h in hist]),
        # Where a step's time goes, seen from the trainer (a3po.training.loop): generating the batch,
        # training on it, waiting for it.
        **{f"mean_{k}_s": _mean([sum(x.get(f"perf/{k}_s", 0.0) for x in h) / len(h) for h in hist]) for k in ("generate", "train", "idle")},
        **{k: (_max if k.endswith("_max") else _mean)([f[k] for f in per_seed]) for k in STABILITY_FIGURES},
        "prox_time_s": _mean([f["prox_time_s"] for f in per_seed]),
        "staleness_mean": _mean([sum(x.get("staleness/mean", 0.0) for x in h) / len(h) for h in hist]),
        "per_seed": per_seed,
    }
    bench: dict[str, list[float]] = {}
    for r in runs:  # benchmark pass@1 etc. (eval/final/<bench>/<metric>), mean over seeds
        for k, val in r.eval_metrics.items():
            if k.startswith("eval/final/") and k.count("/") == 3:
                bench.setdefault(k, []).append(val)
    return {**row, **{k: _mean(vals) for k, vals in bench.items()}}


def _against_baselines(rows: list[dict[str, Any]], arms: list[Arm]) -> dict[str, float]:
    """Speedups and deltas of each row (of ``arms``, in order) against its baselines
    (:func:`baselines_of`), written into the rows (``speedup_*_vs_<baseline>``; an OPPO arm's own
    variant also as ``..._vs_oppo_off``) and returned as metrics."""
    metrics: dict[str, float] = {}
    index = {row["variant"]: row for row in rows}
    for arm, row in zip(arms, rows, strict=True):
        for base in baselines_of(arm):
            if base.name == arm.name or base.name not in index:
                continue
            b, tag = index[base.name], f"{arm.metric_key}_vs_{base.metric_key}"
            # The columns name the baseline variant (the placement is the row's); the same variant is
            # either its OPPO-off arm or its arm at the baseline bound.
            bare = base.variant.value
            cols = [bare] if base.variant != arm.variant else [bare, "oppo_off"] if base.oppo != arm.oppo else [f"s{BOUND_BASELINE}"]
            for figure, name in (("time_to_target_s", "ttt"), ("mean_step_time_s", "step")):
                if row[figure] and b[figure]:  # None or 0: no speedup
                    row.update({f"speedup_{name}_vs_{c}": b[figure] / row[figure] for c in cols})
                    metrics[f"speedup/{tag}/{'time_to_target' if name == 'ttt' else 'step_time'}"] = b[figure] / row[figure]
            metrics[f"delta/{tag}/final_reward"] = row["final_reward"] - b["final_reward"]
            metrics[f"delta/{tag}/final_acc"] = row["final_acc"] - b["final_acc"]
    return metrics


COLUMNS = [
    ("variant", "variant"), ("placement", "placement"), ("seeds", "seeds"), ("warmstart_acc", "warm-start acc"), ("final_acc", "final held-out acc"),
    ("final_reward", "final reward"), ("time_to_target_s", "time to target (s)"), ("mean_step_time_s", "mean step, wait + update (s)"),
    ("train_wall_s", "train wall (s)"), ("mean_generate_s", "generate (s/step)"), ("mean_train_s", "train (s/step)"),
    ("mean_idle_s", "trainer idle (s/step)"), ("speedup_ttt_vs_sync", "speedup vs sync (target)"),
    ("speedup_ttt_vs_recompute", "speedup vs recompute (target)"), ("speedup_step_vs_sync", "step speedup vs sync"),
    ("speedup_step_vs_recompute", "step speedup vs recompute"), ("behav_iw_max", "behaviour IW max"),
    ("behav_iw_p99", "behaviour IW p99"), ("trust_ratio_max", "trust-region ratio max"), ("clipped_frac", "clipped tokens"),
]
# Shown when an OPPO arm was compared with its variant (OPPO off).
OPPO_COLUMNS = [("speedup_ttt_vs_oppo_off", "speedup vs OPPO off (target)"), ("speedup_step_vs_oppo_off", "step speedup vs OPPO off")]
# Shown when a looser or adaptive bound was compared with the same arm at the baseline bound.
BOUND_COLUMNS = [(f"speedup_ttt_vs_s{BOUND_BASELINE}", f"speedup vs bound {BOUND_BASELINE} (target)"),
                 (f"speedup_step_vs_s{BOUND_BASELINE}", f"step speedup vs bound {BOUND_BASELINE}")]


def table(comp: Comparison):
    """The comparison as a DataFrame (OPPO, bound and benchmark columns appended when present)."""
    import pandas as pd

    bench = sorted({k for r in comp.rows for k in r if k.startswith("eval/final/") and k.endswith("/pass_at_1")})
    present = [c for c in OPPO_COLUMNS + BOUND_COLUMNS if any(c[0] in r for r in comp.rows)]
    cols = list(COLUMNS) + present + [(k, k.removeprefix("eval/final/").replace("/pass_at_1", " pass@1")) for k in bench]
    return pd.DataFrame([{label: row.get(key) for key, label in cols} for row in comp.rows])


def to_markdown(df) -> str:
    """A Markdown table without the optional ``tabulate`` dependency."""

    def fmt(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def plot(records: Sequence[dict[str, Any]], comp: Comparison, out_dir: Path, smooth_frac: float = SMOOTH_FRAC) -> list[Path]:
    """reward_curves.png: smoothed reward against step and against trainer wall clock, and the
    held-out accuracy against trainer wall clock (warm start at 0, each evaluation during
    training, the final checkpoint's at the end), every arm on one figure; stability.png against step: behaviour importance weight
    (``pi_prox / pi_behav``) and trust-region ratio (``pi_theta / pi_prox``), step max and p99 on
    log scales, the clipped-token fraction and the fraction of tokens over the behaviour-weight cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(arm_of(r) for r in records))}
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.6))
    fig2, ((b1, b2), (b3, b4)) = plt.subplots(2, 2, figsize=(12, 8))
    seen = set()
    for r in records:
        h = r["history"]
        if not h:
            continue
        v = arm_of(r)
        steps = list(range(1, len(h) + 1))
        sm = smooth([x["reward/mean"] for x in h], window(len(h), smooth_frac))
        label = v if v not in seen else None
        seen.add(v)
        a1.plot(steps, sm, color=colors[v], label=label)
        a2.plot([x["time/train_wall_s"] for x in h], sm, color=colors[v], label=label)
        acc = [(0.0, r["warmstart_acc"]), *((x["time/train_wall_s"], x["eval/heldout_acc"]) for x in h if "eval/heldout_acc" in x),
               (h[-1]["time/train_wall_s"], r["final_acc"])]
        a3.plot([t for t, _ in acc], [a for _, a in acc], color=colors[v], marker="o", ms=3, label=label)

        def series(key: str, h: list[dict[str, float]] = h) -> list[float]:
            return [x.get(key, float("nan")) for x in h]

        for ax, name in ((b1, "behav_iw"), (b2, "trust_ratio")):
            ax.plot(steps, series(f"stability/{name}_max"), color=colors[v], label=f"{v} max" if label else None)
            ax.plot(steps, series(f"stability/{name}_p99"), color=colors[v], ls=":", label=f"{v} p99" if label else None)
        b3.plot(steps, series("stability/trust_ratio_clipped_frac"), color=colors[v], label=label)
        b4.plot(steps, series("stability/behav_iw_capped_frac"), color=colors[v], label=label)
    for ax in (a1, a2):
        if comp.target is not None:
            ax.axhline(comp.target, color="grey", ls="--", lw=0.8, label="target")
        ax.set_ylabel(f"reward (trailing mean, {smooth_frac:.0%} of steps)")
        ax.legend()
    a1.set_xlabel("step")
    a2.set_xlabel("trainer wall clock (s)")
    a3.set(xlabel="trainer wall clock (s)", ylabel="held-out accuracy (sampled)")
    a3.legend()
    fig.suptitle("Reward and held-out accuracy by arm: faster to the same accuracy is further left")
    b1.set(xlabel="step", ylabel="behaviour IW  pi_prox / pi_behav", yscale="log", title="off-policy importance weight (step max, p99)")
    b2.set(xlabel="step", ylabel="trust-region ratio  pi_theta / pi_prox", yscale="log", title="trust-region ratio (step max, p99)")
    b3.set(xlabel="step", ylabel="fraction of tokens", title="clipped tokens (trust region active)")
    b4.set(xlabel="step", ylabel="fraction of tokens", title="behaviour IW above the cap (dropped)")
    for ax in (b1, b2):  # plain numbers at 1, 2, 5, 10, ... on the log axes (not 1.002 x 10^0)
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (b1, b2, b3):
        ax.legend(fontsize="small")
    fig2.suptitle("Stability: importance weights and trust region")
    paths = [out_dir / "reward_curves.png", out_dir / "stability.png"]
    for f, p in zip((fig, fig2), paths, strict=True):
        f.tight_layout()
        f.savefig(p, dpi=110)
        plt.close(f)
    return paths


@task(cache_policy=NO_CACHE)
def summarise(records: list[dict[str, Any]], out_dir: str, target_fraction: float = TARGET_FRACTION,
              smooth_frac: float = SMOOTH_FRAC) -> dict[str, Any]:
    """Write comparison.md / .csv, the plots and summary.json to ``out_dir``; return the figures.
    ``records`` carry ``history_path`` (read here) rather than the histories themselves."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    full = [{**r, "history": read_history(r["history_path"])} for r in records]
    comp = compare([ArmRun.of(r) for r in full], target_fraction, smooth_frac)
    df = table(comp)
    md = to_markdown(df)
    target = f"{comp.target:.3f}" if comp.target is not None else "undefined"
    (out / "comparison.md").write_text(
        md + f"\n\nTarget reward {target} (first-step reward + {target_fraction:.0%} of the best improvement); "
        f"final reward = mean over the last {smooth_frac:.0%} of steps. Behaviour IW = pi_prox / pi_behav (max over steps; "
        f"p99: mean over steps of the step's 99th percentile); trust-region ratio = pi_theta / pi_prox (max over steps); "
        f"clipped tokens = mean over steps of the step's fraction of tokens whose clipped term is active.\n"
        + "".join(f"\nNote: {n}" for n in comp.notes)
    )
    step0 = next((r["step0_eval"] for r in records if r.get("step0_eval")), {})
    if step0:  # the model every arm starts from, on the same benchmark slices as the final models
        with open(out / "comparison.md", "a") as f:
            f.write("\nStep-0 model (before RL): " + ", ".join(f"{k.removeprefix('eval/step0/')} {v:.3f}" for k, v in sorted(step0.items())
                                                              if k.endswith("/pass_at_1")) + "\n")
        comp.metrics.update({f"summary/step0/{k.removeprefix('eval/step0/')}": v for k, v in step0.items()})
    df.to_csv(out / "comparison.csv", index=False)
    plots = plot(full, comp, out, smooth_frac)
    summary = {"rows": comp.rows, "metrics": comp.metrics, "target": comp.target, "notes": comp.notes, "table_md": md}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return {**summary, "artifacts": [str(out / "comparison.md"), str(out / "comparison.csv"), *map(str, plots), str(out / "summary.json")]}
