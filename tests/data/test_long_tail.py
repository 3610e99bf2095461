"""The long-tailed workload of the embedded task (data.long_tail_frac): off, the problems are
exactly those of earlier versions; on, a fraction are multi-step chains with gold answers that
follow from the question's own numbers and answers several times longer."""

from __future__ import annotations

import re

import pytest

from a3po.config import ConfigError, preset, with_overrides
from a3po.data.arithmetic import WORDS, ArithmeticDifficulty, generate_split
from a3po.models.tokenizer import build_tokenizer


def test_off_draws_the_same_problems_as_before():
    assert generate_split(50, "train", 3, ArithmeticDifficulty(long_tail_frac=0.0)) == generate_split(50, "train", 3)


def test_a_fraction_are_chains_with_golds_from_the_question_and_longer_answers():
    tok = build_tokenizer(WORDS)
    rows = generate_split(400, "train", 0, ArithmeticDifficulty(long_tail_frac=0.25, long_tail_steps=5, slip_rate=0.0))
    chains = [r for r in rows if r["prompt"].count("more.") + r["prompt"].count("away") >= 2 and "bags" not in r["prompt"]]
    assert 0.15 < len(chains) / len(rows) < 0.35  # 0.25 +- ~4.5 binomial sigmas at n = 400
    for r in chains:
        # Recompute the gold from the question text: start amount, then +x per "buys x more", -x per "gives away x".
        start = int(re.search(r"has (\d+) ", r["prompt"]).group(1))
        deltas = [int(x) for x in re.findall(r"buys (\d+) more", r["prompt"])] + [-int(x) for x in re.findall(r"gives away (\d+)", r["prompt"])]
        assert len(deltas) == 4 and int(r["gold"]) == start + sum(deltas) >= 0
        assert r["solution"].count("\n") == 4 and r["solution"].endswith(f"#### {r['gold']}")
        assert tok.unk_token_id not in tok(r["prompt"] + r["solution"])["input_ids"]  # same vocabulary
    def length(rs):
        return sum(len(tok(r["solution"])["input_ids"]) for r in rs) / len(rs)

    assert length(chains) > 2.5 * length([r for r in rows if r not in chains])


def test_heldout_chains_stay_disjoint_from_train():
    d = ArithmeticDifficulty(long_tail_frac=0.5)
    train = {r["prompt"] for r in generate_split(300, "train", 0, d)}
    assert not train & {r["prompt"] for r in generate_split(100, "heldout", 0, d)}


@pytest.mark.parametrize("data, match", [({"long_tail_frac": 1.5}, "long_tail_frac"), ({"long_tail_steps": 1}, "long_tail_steps")])
def test_bounds(data, match):
    with pytest.raises(ConfigError, match=match):
        with_overrides(preset("micro"), data=data)
