"""Grading throughput: 1000 realistic completions (GSM8K / MATH500 / AIME style) under 10 s.

    python -m bench.grading [--n 1000] [--data-dir DIR] [--budget-s 10]

Why: the grader sits on the RL reward path and on every benchmark item, and its symbolic
comparisons run in a separate math-verify worker; this measures the whole thing as a caller
sees it, cold worker start included. The completions are real worked solutions where the data
is available (GSM8K answers ending in ``#### N``, MATH solutions ending in ``\\boxed{}``, AIME
solutions with a boxed answer appended), half of them with the final answer made wrong, so the
fast path and the math-verify path are both exercised and every decision is checked.

Data: ``--data-dir``, else ``$A3PO_SHARED_DATA`` or ``../shared/data`` when present, else the
shipped fixtures (``eval/fixtures``). Prints a table, then one JSON line of the key figures.
Exit status 1 when over budget or when any decision is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from eval.data import BENCHMARKS, EvalRecord, fixture_path, load_benchmark
from eval.synthetic import STYLES, natural_completion, wrong_answer

MIX = {"gsm8k": 0.5, "math500": 0.4, "aime24": 0.1}  # share of completions per benchmark


def shared_data_dir() -> Path | None:
    """``$A3PO_SHARED_DATA`` or ``../shared/data`` next to the repo root, when it exists."""
    env = os.environ.get("A3PO_SHARED_DATA")
    p = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return p if p.is_dir() else None


def _completion(bench: str, rec: EvalRecord, wrong: bool, rng: random.Random) -> str:
    """A worked solution ending in the gold (or in a wrong answer)."""
    if bench == "gsm8k":
        answer = rec.metadata["answer"]  # the reference solution, "...\n#### N"
        if not wrong:
            return answer
        head, _, tail = answer.rpartition("####")
        return f"{head}#### {wrong_answer(tail.strip())}"
    final = wrong_answer(rec.gold) if wrong else rec.gold
    solution = str(rec.metadata.get("solution") or "")
    if bench == "math500" and "\\boxed{" + rec.gold + "}" in solution:
        i = solution.rfind("\\boxed{" + rec.gold + "}")
        return solution[:i] + "\\boxed{" + final + "}" + solution[i + len("\\boxed{" + rec.gold + "}") :]
    if solution:
        return f"{solution}\nSo the answer is \\boxed{{{final}}}."
    return natural_completion(final, rng.choice(STYLES))


def build_mix(n: int, source: Path | None, seed: int = 0) -> list[tuple[str, str, str, float]]:
    """``n`` items ``(task, completion, gold, expected score)`` in the MIX proportions."""
    rng = random.Random(seed)
    items: list[tuple[str, str, str, float]] = []
    for bench, share in MIX.items():
        recs = load_benchmark(bench, source if source is not None else fixture_path(bench))
        task = BENCHMARKS.get(bench).task
        for j in range(round(n * share)):
            rec = rng.choice(recs)
            wrong = j % 2 == 1
            items.append((task, _completion(bench, rec, wrong, rng), rec.gold, 0.0 if wrong else 1.0))
    rng.shuffle(items)
    return items[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grading", description="grading throughput")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--budget-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    source = Path(args.data_dir) if args.data_dir else shared_data_dir()
    items = build_mix(args.n, source, args.seed)

    from a3po import grading

    grading.reset_stats()
    per_task: dict[str, list[float]] = {}
    wrong_decisions = []
    t0 = time.perf_counter()  # cold: includes starting the math-verify worker
    for task, completion, gold, expected in items:
        t = time.perf_counter()
        s = grading.score(task, completion, gold)
        per_task.setdefault(task, []).append(time.perf_counter() - t)
        if s != expected:
            wrong_decisions.append((task, gold, expected, s))
    total = time.perf_counter() - t0
    st = grading.stats()

    lat = [x for xs in per_task.values() for x in xs]
    print(f"grading bench: {len(items)} completions, data: {source or 'eval/fixtures'}")
    print(f"{'task':<8}  {'n':>5}  {'mean ms':>8}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}")
    for task, xs in sorted(per_task.items()):
        xs_ms = sorted(x * 1e3 for x in xs)
        print(
            f"{task:<8}  {len(xs):>5}  {statistics.mean(xs_ms):>8.2f}  {xs_ms[len(xs_ms) // 2]:>7.2f}  "
            f"{xs_ms[int(0.99 * (len(xs_ms) - 1))]:>7.2f}  {xs_ms[-1]:>7.1f}"
        )
    print(f"total {total:.2f} s (budget {args.budget_s:.0f} s), fast path {st['fast']}, math-verify {st['math_verify']}, "
          f"timeouts {st['timeouts']}, wrong decisions {len(wrong_decisions)}")
    for w in wrong_decisions[:10]:
        print("  wrong decision:", w)
    figures = {
        "n": len(items), "seconds": round(total, 3), "per_item_ms": round(1e3 * total / max(len(items), 1), 3),
        "p99_ms": round(1e3 * sorted(lat)[int(0.99 * (len(lat) - 1))], 3), "fast": st["fast"], "math_verify": st["math_verify"],
        "timeouts": st["timeouts"], "wrong_decisions": len(wrong_decisions), "budget_s": args.budget_s,
        "data": "shared" if source is not None and args.data_dir is None else (str(source) if source else "fixtures"),
    }
    print(json.dumps(figures))
    return 0 if total <= args.budget_s and not wrong_decisions else 1


if __name__ == "__main__":
    raise SystemExit(main())
