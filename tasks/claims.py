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
behav_iw_extremes   max behaviour IW loglinear / recompute                 < 1     "more controlled": smaller
clipped_tokens      clipped fraction loglinear - fewest of the others      <= 0    "clips the fewest" (ties pass)
==================  ===================================================  ========  ==============================
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
from tasks.verdicts import NothingToJudge, all_pass

REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"

PAPER = "Li, Wu, Shen: A-3PO, arXiv:2512.06547"
BLOG = "authors' blog post (hsiaotsan.github.io/blog/posts/a3po-efficient-async-llm-training)"
AREAL_DOCS = "AReaL docs/algorithms/prox_approx.md (GSM8K, Qwen2.5-1.5B-Instruct, 300 steps, staleness 8)"

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


def _reward_gap(rows: Rows, target: float | None) -> Measurement:
    ll, rc = per_seed(rows, "loglinear", "final_reward"), per_seed(rows, "recompute", "final_reward")
    if ll is None or rc is None:
        return NotMeasurable(f"{'loglinear' if ll is None else 'recompute'} was not run")
    seeds = sorted(set(ll) & set(rc))
    if not seeds:
        return NotMeasurable("no seed shared by loglinear and recompute")
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
          "1.8x (26.15 h -> 14.54 h of training); AReaL docs: 1.27x (207 -> 163 min)", f"{PAPER} v3 abstract; {BLOG}; {AREAL_DOCS}",
          "wall time to target, recompute / loglinear", "x",
          _ratio("recompute", "loglinear", "time_to_target_s", "time to target", " s"), Rule(">", 1.0)),
    Claim("ttt_vs_sync", "asynchronous training with A-3PO is faster than synchronous training",
          "qualitative: no A-3PO figure against synchronous training found; the paper motivates async RL by sync's idle time",
          f"{PAPER}, introduction", "wall time to target, sync / loglinear", "x",
          _ratio("sync", "loglinear", "time_to_target_s", "time to target", " s"), Rule(">", 1.0)),
    Claim("reward_parity", "final performance comparable to recompute",
          "qualitative 'comparable performance'; AReaL docs: final task reward 0.937 vs 0.954, eval reward 0.799 vs 0.795",
          f"{PAPER} abstract; {AREAL_DOCS}", "final reward, loglinear - recompute", "",
          _reward_gap, Rule(">=", -0.05)),
    Claim("behav_iw_extremes", "more controlled importance weights (pi_prox / pi_behav)",
          "qualitative: 'better stability with more controlled importance weights'; no figure found", BLOG,
          "max behaviour IW over the run, loglinear / recompute", "x",
          _ratio("loglinear", "recompute", "behav_iw_max", "max behaviour IW"), Rule("<", 1.0)),
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


def check_claims(rows: Rows, target: float | None, claims: Sequence[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """One result per claim and placement: paper figure, testbed figure with spread, verdict and
    reason. Results of a placement other than colocated carry it in their key (``ttt_vs_sync_on_disaggregated``)."""
    groups = rows_by_placement(rows)
    if not groups:
        raise NothingToJudge("no comparison rows for the claims: every claim compares variants that ran")
    out = []
    for placement, group in groups.items():
        suffix = "" if placement == "colocated" else f"_on_{placement}"
        out += [{**r, "claim": r["claim"] + suffix, "placement": placement} for r in _check(group, target, claims)]
    return out


def _check(rows: Rows, target: float | None, claims: Sequence[Claim]) -> list[dict[str, Any]]:
    out = []
    for c in claims:
        m = c.measure(rows, target)
        verdict, reason = judge(c, m)
        measured = isinstance(m, Measured)
        out.append({
            "claim": c.key, "statement": c.statement, "paper": c.paper, "source": c.source, "quantity": c.quantity, "rule": str(c.rule),
            "testbed": spread(list(m.values.values()), c.unit) + f"; {m.detail}" if measured else "-",
            "values": {str(s): v for s, v in m.values.items()} if measured else {},
            "verdict": verdict, "reason": reason,
        })
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def claims_markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| claim | paper | this testbed | verdict | reason |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(
            "| "
            + " | ".join(_cell(x) for x in (f"{r['statement']} ({r['claim']})", r["paper"], r["testbed"], f"**{r['verdict']}**", r["reason"]))
            + " |"
        )
    lines += ["", "Sources of the paper's figures:", ""] + list(dict.fromkeys(f"- {r['claim']}: {r['source']}" for r in results))
    lines += ["", "Rule (tasks/claims.py): reproduced iff the value passes its threshold on every seed; "
              "not measurable here when the quantity does not exist in this run."]
    return "\n".join(lines) + "\n"


def claims_metrics(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``claims/<key>/reproduced`` (1 or 0; absent when not measurable), ``.../mean`` of the values."""
    m: dict[str, float] = {}
    for r in results:
        if r["verdict"] != NOT_MEASURABLE:
            m[f"claims/{r['claim']}/reproduced"] = float(r["verdict"] == REPRODUCED)
            m[f"claims/{r['claim']}/mean"] = _mean(list(r["values"].values()))
    m["claims/reproduced"] = float(sum(r["verdict"] == REPRODUCED for r in results))
    return {k: v for k, v in m.items() if math.isfinite(v)}


@task(cache_policy=NO_CACHE)
def report_claims(summary: dict[str, Any], out_dir: str, header: str) -> dict[str, Any]:
    """Judge the claims on a comparison summary (``tasks.summary.summarise``'s); write claims.md
    (``header`` first) and claims.json to ``out_dir``."""
    results = check_claims(summary["rows"], summary["target"])
    md = claims_markdown(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "claims.md").write_text(f"{header}\n\n{md}")
    (out / "claims.json").write_text(json.dumps({"results": results, "target": summary["target"]}, indent=1))
    return {"results": results, "markdown": md, "metrics": claims_metrics(results), "artifacts": [str(out / "claims.md"), str(out / "claims.json")]}

