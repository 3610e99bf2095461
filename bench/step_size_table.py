"""The ESS step size against the fixed step, per staleness bound, from two finished comparisons.

Reads the run folders of two ``flows.compare_variants`` outputs that differ only in
``rl.step_size`` (the fixed rule's and ``ess_sqrt``'s), pairs each arm (``loglinear+s<k>``) and
seed across them, and prints per bound: the final smoothed reward and final held-out accuracy of
each rule, their paired difference (ess minus fixed) with its 95% bootstrap interval over seeds,
the ESS rule's mean step scale and ESS ratio, the behaviour weights' maximum, and the RL wall.
With three seeds the bootstrap interval is coarse (27 resamples at most are distinct): read it
as the spread, not a test. The two comparisons ran at different times, so walls are not a
side-by-side timing.

    python -m bench.step_size_table --fixed runs/stepsize-fixed --ess runs/stepsize-ess_sqrt

Prints the table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from a3po.training.records import finished_record
from tasks.parity import paired_bootstrap_ci
from tasks.summary import final_reward, read_history

RUN_DIR = re.compile(r"^(?P<arm>.+)-seed(?P<seed>\d+)-[0-9a-f]{8}$")


def runs_of(root: Path) -> dict[tuple[str, int], Path]:
    """``(arm, seed) -> run folder`` of every finished run (one with ``result.json``) under ``root``."""
    found = {}
    for d in sorted(root.iterdir()):
        m = RUN_DIR.match(d.name)
        if m and (d / "result.json").is_file():
            found[(m["arm"], int(m["seed"]))] = d
    if not found:
        raise SystemExit(f"{root}: no finished run folder (<arm>-seed<s>-<hash>/result.json)")
    return found


def figures(run: Path, arm: str, seed: int) -> dict[str, float]:
    """The run's figures, from its record only once the record passes the project's checks
    (digests of the record, the history and the final weights; variant and seed)."""
    result_json = json.loads((run / "result.json").read_text())
    checked = finished_record(run, arm.split("+")[0], seed, result_json.get("steps"))
    if checked is None:
        raise SystemExit(f"{run}: not a finished run (no history.jsonl or final/ beside result.json)")
    result = checked[0]
    history = read_history(run / "history.jsonl")  # merged by step, as the comparison reads it

    def mean_of(key: str) -> float:
        xs = [h[key] for h in history if key in h]
        return float(np.mean(xs)) if xs else float("nan")

    return {"final_reward": final_reward(history), "final_acc": float(result["final_acc"]),
            "wall_s": float(result["wall_s"]), "lr_scale": mean_of("step_size/lr_scale"),
            "ess_ratio": mean_of("step_size/ess_ratio"),
            "iw_max": max((h.get("stability/behav_iw_max", float("nan")) for h in history), default=float("nan"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixed", type=Path, required=True, help="output folder of the fixed-step comparison")
    parser.add_argument("--ess", type=Path, required=True, help="output folder of the ess_sqrt comparison")
    args = parser.parse_args(argv)
    fixed, ess = runs_of(args.fixed), runs_of(args.ess)
    shared = sorted(set(fixed) & set(ess))
    if not shared:
        raise SystemExit(f"no (arm, seed) finished in both {args.fixed} and {args.ess}")
    rows, out = [], {}
    for arm in sorted({a for a, _ in shared}, key=lambda a: (len(a), a)):
        seeds = [s for a, s in shared if a == arm]
        f = [figures(fixed[(arm, s)], arm, s) for s in seeds]
        e = [figures(ess[(arm, s)], arm, s) for s in seeds]
        row = {"arm": arm, "seeds": len(seeds)}
        for key in ("final_reward", "final_acc"):
            mean, lo, hi = paired_bootstrap_ci([b[key] - a[key] for a, b in zip(f, e, strict=True)])
            row |= {f"fixed_{key}": float(np.mean([a[key] for a in f])), f"ess_{key}": float(np.mean([b[key] for b in e])),
                    f"diff_{key}": mean, f"diff_{key}_lo": lo, f"diff_{key}_hi": hi}
        row |= {"ess_lr_scale": float(np.mean([b["lr_scale"] for b in e])),
                "ess_ratio": float(np.mean([b["ess_ratio"] for b in e])),
                "fixed_iw_max": float(np.max([a["iw_max"] for a in f])), "ess_iw_max": float(np.max([b["iw_max"] for b in e])),
                "fixed_wall_s": float(np.mean([a["wall_s"] for a in f])), "ess_wall_s": float(np.mean([b["wall_s"] for b in e]))}
        rows.append(row)
        out[arm] = row
    print("| arm | seeds | final reward fixed / ess | diff [lo, hi] | held-out fixed / ess | diff [lo, hi] "
          "| ess lr scale | ESS/N | IW max fixed / ess | RL wall fixed / ess (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['seeds']} | {r['fixed_final_reward']:.3f} / {r['ess_final_reward']:.3f} "
              f"| {r['diff_final_reward']:+.3f} [{r['diff_final_reward_lo']:+.3f}, {r['diff_final_reward_hi']:+.3f}] "
              f"| {r['fixed_final_acc']:.3f} / {r['ess_final_acc']:.3f} "
              f"| {r['diff_final_acc']:+.3f} [{r['diff_final_acc_lo']:+.3f}, {r['diff_final_acc_hi']:+.3f}] "
              f"| {r['ess_lr_scale']:.3f} | {r['ess_ratio']:.3f} | {r['fixed_iw_max']:.2f} / {r['ess_iw_max']:.2f} "
              f"| {r['fixed_wall_s']:.0f} / {r['ess_wall_s']:.0f} |")
    print(json.dumps({"step_size_table": out}))


if __name__ == "__main__":
    main()
