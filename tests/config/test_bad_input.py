"""Bad input fails loudly and says where: dataset rows (BadRowError naming source and row, or a
counted skip), config files (unknown fields named with the file), invalid values, unknown
registry names (listing the valid ones), duplicate registrations."""

from __future__ import annotations

import json

import pytest
import yaml

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS
from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import ConfigError, DataConfig, RLConfig, config_from_dict, load_config, merge_yaml, preset
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import BadRowError, load_rows, read_jsonl, validate_rows
from a3po.models.tokenizer import build_tokenizer
from a3po.registry import Registry

pytestmark = pytest.mark.usefixtures("core_one_thread")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


GOOD = {"id": "q1", "prompt": "Question: Mia has 3 pens.\nAnswer: ", "gold": "3"}


def _write(tmp_path, lines, name="rows.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


# --- read_jsonl / validate_rows ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got str"),
    ],
)
def test_non_json_line_names_file_and_line(tmp_path, line, problem):
    p = _write(tmp_path, [json.dumps(GOOD), "", line])  # line 2 is blank (skipped), bad one is line 3
    with pytest.raises(BadRowError, match=f"rows.jsonl: row 3: {problem}"):
        read_jsonl(p)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({}, r"missing field\(s\) \['prompt', 'gold'\]"),
        ({"prompt": "Question: x"}, r"missing field\(s\) \['gold'\]"),
        ({"prompt": "   ", "gold": "3"}, "empty or non-string"),
        ({"prompt": "Question: x", "gold": ""}, "empty or non-string"),
        ({"prompt": "Question: x", "gold": 3}, "empty or non-string"),
        ({"prompt": None, "gold": "3"}, "empty or non-string"),
    ],
)
def test_bad_rows_raise_naming_source_and_row(tok, row, problem):
    rows = [dict(GOOD), dict(GOOD, id="q2"), row]  # ids are unique in a dataset
    with pytest.raises(BadRowError, match=f"^mysrc: row 3: {problem}"):
        validate_rows(rows, tok, max_prompt_tokens=96, on_bad_row="error", source="mysrc")


def test_prompt_over_the_token_budget(tok):
    n = len(tok(GOOD["prompt"], add_special_tokens=False)["input_ids"])
    ok, report = validate_rows([dict(GOOD)], tok, max_prompt_tokens=n, on_bad_row="error", source="s")
    assert len(ok) == 1 and report.n_kept == 1  # exactly at the budget is fine
    with pytest.raises(BadRowError, match=f"^s: row 1: prompt has {n} tokens, over data.max_prompt_tokens={n - 1}"):
        validate_rows([dict(GOOD)], tok, max_prompt_tokens=n - 1, on_bad_row="error", source="s")


def test_skip_mode_counts_every_kind_of_bad_row_from_a_file(tmp_path, tok):
    long_prompt = "Question: " + "Mia has 3 pens. " * 30
    p = _write(tmp_path, [
        json.dumps(GOOD),                                   # 1 ok
        "{oops",                                            # 2 not JSON
        json.dumps({"prompt": "Question: x"}),              # 3 missing gold
        json.dumps({"prompt": "", "gold": "1"}),            # 4 empty prompt
        json.dumps({"prompt": long_prompt, "gold": "1"}),   # 5 too long
        "",                                                 # (blank: not a row)
        json.dumps({**GOOD, "id": 7}),                      # 7 ok (int id)
    ])
    cfg = DataConfig(train_path=str(p), heldout_path=str(p), on_bad_row="skip", max_prompt_tokens=96)
    train, held, reports = load_rows(cfg, tok)
    assert len(train) == len(held) == 2
    rep = reports[0]
    assert (rep.source, rep.n_rows, rep.n_kept, len(rep.skipped)) == (str(p), 6, 2, 4)
    assert [s.split(": ")[1] for s in rep.skipped] == ["row 2", "row 3", "row 4", "row 5"]
    assert "not valid JSON" in rep.skipped[0] and "over data.max_prompt_tokens" in rep.skipped[3]
    assert rep.as_metrics("data/train") == {"data/train/rows": 6.0, "data/train/skipped_rows": 4.0}
    assert [r["id"] for r in train] == ["q1", "7"]  # ids are strings
    assert all("_row" not in r and "_error" not in r for r in train)
    # ...and in error mode the same file stops at its first bad row, naming it.
    with pytest.raises(BadRowError, match="row 2: not valid JSON"):
        load_rows(DataConfig(train_path=str(p), heldout_path=str(p)), tok)


def test_no_usable_rows_is_an_error_even_in_skip_mode(tok):
    with pytest.raises(BadRowError, match=r"^src: no usable rows \(2 skipped\)"):
        validate_rows([{}, {"prompt": "x"}], tok, max_prompt_tokens=96, on_bad_row="skip", source="src")


@pytest.mark.parametrize(
    ("section", "field", "value", "allowed"),
    [
        ("data", "on_bad_row", "ignore", "'error', 'skip'"),
        ("rl", "schedule", "async", "'deterministic', 'threaded'"),
        ("rl", "lr_schedule", "linear", "'constant', 'cosine'"),
        ("rollout", "weight_updates", "sometimes", "'decode_step', 'batch'"),
    ],
)
def test_a_field_of_fixed_choices_lists_them(section, field, value, allowed):
    with pytest.raises(ConfigError, match=rf"^config: {section}\.{field}: expected one of {allowed}, got '{value}' \(str\)$"):
        config_from_dict({section: {field: value}})


# --- configs -----------------------------------------------------------------------------------------


def _yaml(tmp_path, values, name="run.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(values))
    return p


def test_unknown_field_names_the_file_and_the_field(tmp_path):
    p = _yaml(tmp_path, {"rl": {"steps": 3, "learning_rate": 0.1}})
    with pytest.raises(ValueError, match=rf"{p}\.rl: unknown field\(s\) \['learning_rate'\]") as err:
        load_config(p)
    assert "'lr'" in str(err.value)  # lists the valid fields
    q = _yaml(tmp_path, {"modle": {"name": "tiny"}}, "top.yaml")
    with pytest.raises(ValueError, match=rf"{q}: unknown field\(s\) \['modle'\]"):
        load_config(q)
    with pytest.raises(ValueError, match=rf"{q}: unknown field"):
        merge_yaml(preset("micro"), q)


def test_valid_yaml_loads(tmp_path):
    p = _yaml(tmp_path, {"rl": {"variant": "recompute", "steps": 3}, "model": {"name": "micro"}})
    cfg = load_config(p)
    assert cfg.rl.variant.value == "recompute" and cfg.rl.steps == 3 and cfg.model.name == "micro"


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"minibatches": 3}, "minibatches must divide"),  # 16 * 8 = 128 is not divisible by 3
        ({"minibatches": 0}, "minibatches"),
        ({"batch_prompts": 3, "group_size": 3, "minibatches": 2}, "minibatches must divide"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"behav_weight_cap": 1.0}, "behav_weight_cap"),
        ({"steps": 0}, "steps"),
    ],
)
def test_invalid_rl_values_raise_when_built(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        RLConfig(**kw)


def test_invalid_minibatches_from_yaml(tmp_path):
    p = _yaml(tmp_path, {"rl": {"batch_prompts": 4, "group_size": 2, "minibatches": 3}})
    with pytest.raises(ValueError, match="minibatches must divide"):
        load_config(p)


def test_unknown_proximal_and_advantage_names_list_the_valid_ones():
    with pytest.raises(KeyError, match="unknown proximal method 'exact'; valid: behaviour, loglinear, metrics, recompute"):
        RLConfig(proximal="exact")
    with pytest.raises(KeyError, match="unknown advantage estimator 'vtrace'; valid: dr_grpo, gae, grpo"):
        RLConfig(advantage="vtrace")


def test_registry_duplicate_name_raises_and_unknown_lists_valid():
    reg: Registry[int] = Registry("thing")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")(2)
    assert reg.get("a") == 1  # the first registration is kept
    with pytest.raises(KeyError, match="unknown thing 'b'; valid: a"):
        reg.get("b")
    # the real registries refuse to be overwritten too
    with pytest.raises(ValueError, match="already registered"):
        PROXIMAL_METHODS.register("loglinear")(object())
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda r, g: r)


# --- rewards -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_raises_naming_the_row(monkeypatch, bad):
    import a3po.grading
    from a3po.grading.rewards import RewardError, score_completions

    # A grader (or a custom reward) that returns a non-finite score for one completion.
    monkeypatch.setattr(
        a3po.grading, "grade",
        lambda task, completion, gold, **kw: a3po.grading.GradeResult(bad if completion == "boom" else 1.0, None, "none", "skipped", gold),
    )
    assert score_completions("arith", ["ok"], ["1"], ["row-a"]) == [1.0]
    with pytest.raises(RewardError, match=r"reward for row 'row-b' is not finite"):
        score_completions("arith", ["ok", "boom"], ["1", "1"], ["row-a", "row-b"])
