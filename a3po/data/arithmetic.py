"""The embedded task: seeded arithmetic word problems with GSM8K-style gold answers.

Each problem has a one-line worked solution and a final ``#### N`` line, like GSM8K::

    Question: Mia has 3 pens. She buys 5 more. How many pens does Mia have now?
    Answer: 3 + 5 = 8
    #### 8

Train and held-out problems are disjoint by construction: a problem is held out when a hash
of its text's ingredients (template, name, item, operands) falls in the held-out bucket,
whatever the seed. No held-out question appears in training; the arithmetic facts behind them
do (with single-digit operands there are only ~200 of them), so held-out accuracy measures
whether the policy computes the answer reliably, which is what RL can improve.

The warm-start solutions come from a careless teacher: a fraction ``slip_rate`` of them carry
a result off by 1 or 2 (``3 + 5 = 9 / #### 9``). Supervised learning on them yields a policy
with the format and the facts but a habit of near misses, a realistic starting point for RL
with a verifiable reward (distilled reasoning traces contain such slips), and one a 2-core CPU
can improve in minutes. With clean solutions, the tiny model's errors are mostly failures to
copy operands and its RL gains are a few points in 10 minutes (docs/results.md).
"""

from __future__ import annotations

import hashlib
import random

from a3po.config import ArithmeticDifficulty

NAMES = ["Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Eva", "Tom", "Amy", "Jay"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs", "cups", "shells", "stamps", "rocks"]
PRONOUN = {n: ("She" if n in {"Mia", "Ava", "Zoe", "Ivy", "Eva", "Amy"} else "He") for n in NAMES}

# (template, op); templates see name, pronoun, item, a, b.
TEMPLATES: list[tuple[str, str]] = [
    ("{name} has {a} {item}. {pronoun} buys {b} more. How many {item} does {name} have now?", "+"),
    ("{name} has {a} {item} and finds {b} more. How many {item} does {name} have in total?", "+"),
    ("{name} has {a} {item}. {pronoun} gives away {b}. How many {item} are left?", "-"),
    ("{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?", "-"),
    ("{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?", "*"),
]

WORDS = sorted(
    {w.strip(".?,") for t, _ in TEMPLATES for w in t.split() if not w.startswith("{")}
    | set(NAMES) | set(ITEMS) | {"She", "He", "Question", "Answer"}
)
PROMPT_FORMAT = "Question: {question}\nAnswer: "


def _is_heldout(key: str, fraction: float) -> bool:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < fraction * 10_000


def make_problem(rng: random.Random, diff: ArithmeticDifficulty, slip: random.Random | None = None) -> dict:
    """One problem drawn from ``rng``. With ``slip`` (a stream of its own, so the problem does not
    depend on the slip rate) the worked solution is the careless teacher's: with probability
    ``diff.slip_rate`` its result is off by 1 or 2 (never negative); the gold stays right."""
    t_idx = rng.randrange(len(TEMPLATES))
    template, op = TEMPLATES[t_idx]
    if op == "*":
        a, b = rng.randint(2, diff.max_mul), rng.randint(2, diff.max_mul)
        c = a * b
    else:
        a, b = rng.randint(1, diff.max_add), rng.randint(1, diff.max_add)
        if op == "-":
            a, b = max(a, b), min(a, b)
            c = a - b
        else:
            c = a + b
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = template.format(name=name, pronoun=PRONOUN[name], item=item, a=a, b=b)
    written = c
    if slip is not None and slip.random() < diff.slip_rate:
        written = c + slip.choice([d for d in (-2, -1, 1, 2) if c + d >= 0])
    return {
        "key": f"{t_idx}:{name}:{item}:{a}:{b}",
        "prompt": PROMPT_FORMAT.format(question=question),
        "solution": f"{a} {op} {b} = {written}\n#### {written}",
        "gold": str(c),
    }


def make_chain_problem(rng: random.Random, diff: ArithmeticDifficulty, slip: random.Random | None = None) -> dict:
    """A long-tail problem: a start amount, then ``diff.long_tail_steps - 1`` buys / gives away,
    solved one line per operation (never negative). Uses only words of :data:`TEMPLATES`, so the
    tokenizer's vocabulary is unchanged."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(1, diff.max_add)
    sentences, lines, ops = [f"{name} has {total} {item}."], [], [str(total)]
    for _ in range(diff.long_tail_steps - 1):
        x = rng.randint(1, diff.max_add)
        if rng.random() < 0.5 and x <= total:
            sentences.append(f"{PRONOUN[name]} gives away {x}.")
            lines.append(f"{total} - {x} = {total - x}")
            total -= x
            ops.append(f"-{x}")
        else:
            sentences.append(f"{PRONOUN[name]} buys {x} more.")
            lines.append(f"{total} + {x} = {total + x}")
            total += x
            ops.append(f"+{x}")
    written = total
    if slip is not None and slip.random() < diff.slip_rate:
        written = total + slip.choice([d for d in (-2, -1, 1, 2) if total + d >= 0])
        lines[-1] = lines[-1].rsplit("=", 1)[0] + f"= {written}"
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return {
        "key": f"chain:{name}:{item}:{':'.join(ops)}",
        "prompt": PROMPT_FORMAT.format(question=question),
        "solution": "\n".join(lines) + f"\n#### {written}",
        "gold": str(total),
    }


def generate_split(n: int, split: str, seed: int, diff: ArithmeticDifficulty | None = None) -> list[dict]:
    """``n`` problems of ``split`` ("train" or "heldout"), deterministic in ``seed``, at ``diff``
    (default: :class:`~a3po.config.ArithmeticDifficulty`'s defaults). Rows carry ``id``,
    ``prompt``, ``gold`` (the number after ``####``), ``solution`` and ``task``."""
    diff = diff or ArithmeticDifficulty()
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    rng = random.Random(f"{seed}:{split}")
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 200 * (n + 10):
            raise RuntimeError(f"could not draw {n} {split} problems; widen the difficulty ranges")
        slip = random.Random(f"{seed}:{split}:slip:{len(rows)}") if not want_heldout else None
        p = make_problem(rng, diff, slip)
        if diff.long_tail_frac > 0:  # a stream of its own: frac = 0 draws what earlier versions drew
            tail = random.Random(f"{seed}:{split}:tail:{attempts}")
            if tail.random() < diff.long_tail_frac:
                p = make_chain_problem(tail, diff, slip)
        if _is_heldout(p.pop("key"), diff.heldout_fraction) != want_heldout:
            continue
        rows.append({"id": f"arith-{split}-{seed}-{len(rows)}", "task": "arith", **p})
    return rows
