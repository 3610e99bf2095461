"""Configs and datasets that fail by name (issue 8, findings 4 and 5).

Config values are checked against their field's type when a config is built, and every error
names the file and the dotted field: through the library (``load_config`` / ``merge_yaml`` /
``with_overrides``), through ``a3po train`` in a subprocess (exit 2, one line, nothing trained)
and through the flow's command line (``--config`` and ``--set`` read values alike). Dataset lines
that are not UTF-8 are named by file, row and byte offset, or skipped and counted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from a3po import config as config_mod
from a3po.config import ConfigError, DataConfig, load_config, merge_yaml, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import BadRowError, load_rows, read_jsonl
from a3po.models.tokenizer import build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- types of config values (library) --------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("1e-4", 1e-4), ("3E-5", 3e-5), (".5", 0.5), ("'1e-4'", 1e-4), ("2", 2.0)])
def test_yaml_numbers_in_float_fields_are_floats(tmp_path, text, expected):
    # PyYAML (YAML 1.1) reads 1e-4 and 3E-5 as strings; quoted '1e-4' is a string in any YAML.
    cfg = load_config(_yaml(tmp_path, f"rl: {{lr: {text}}}\n"))
    assert type(cfg.rl.lr) is float and cfg.rl.lr == expected


@pytest.mark.parametrize(
    ("text", "got"),
    [
        ("abc", "'abc' (str)"),
        ("nan", "'nan' (str)"),  # the word: not a number to YAML either
        (".nan", "nan (float)"),  # YAML's NaN: a float, but no field means it
        (".inf", "inf (float)"),
        ("true", "True (bool)"),
        ("[1]", "[1] (list)"),
    ],
)
def test_float_field_refuses_text_bools_and_non_finite(tmp_path, text, got):
    p = _yaml(tmp_path, f"rl: {{lr: {text}}}\n")
    with pytest.raises(ConfigError) as err:
        merge_yaml(preset("micro"), p)
    msg = str(err.value)
    assert msg.startswith(f"{p}: rl.lr: expected a") and msg.endswith(f"got {got}"), msg


def test_the_reported_lr_abc_names_file_and_field(tmp_path):
    # The user's report: a TypeError "'<=' not supported between 'str' and 'int'" before.
    p = _yaml(tmp_path, "rl: {lr: abc}\n", "my.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: rl\.lr: expected a float, got 'abc' \(str\)$"):
        load_config(p)


def test_int_field_refuses_fractions_and_bools_and_takes_integral_floats(tmp_path):
    with pytest.raises(ConfigError, match=r"^.*a\.yaml: rl\.steps: expected an integer, got 2\.5 \(float\)$"):
        load_config(_yaml(tmp_path, "rl: {steps: 2.5}\n", "a.yaml"))
    with pytest.raises(ConfigError, match=r"b\.yaml: rl\.batch_prompts: expected an integer, got True \(bool\)$"):
        load_config(_yaml(tmp_path, "rl: {batch_prompts: true}\n", "b.yaml"))
    with pytest.raises(ConfigError, match=r"c\.yaml: torch_threads: expected an integer, got '2' \(str\)$"):
        load_config(_yaml(tmp_path, "torch_threads: '2'\n", "c.yaml"))
    cfg = load_config(_yaml(tmp_path, "rl: {steps: 3.0, checkpoint_every: 1e1}\n", "d.yaml"))
    assert (cfg.rl.steps, cfg.rl.checkpoint_every) == (3, 10) and type(cfg.rl.steps) is int


def test_unknown_enum_value_lists_the_valid_ones(tmp_path):
    p = _yaml(tmp_path, "rl: {variant: fast}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: rl\.variant: expected one of 'sync', 'recompute', 'loglinear', got 'fast' \(str\)$"):
        load_config(p)
    assert load_config(_yaml(tmp_path, "rl: {variant: sync}\n", "ok.yaml")).rl.variant is config_mod.Variant.SYNC


def test_null_only_for_optional_fields(tmp_path):
    cfg = load_config(_yaml(tmp_path, "rl: {eps_clip_high: null, behav_weight_cap: null}\ndata: {train_path: null}\n", "ok.yaml"))
    assert (cfg.rl.eps_clip_high, cfg.rl.behav_weight_cap, cfg.data.train_path) == (None, None, None)
    for text, dotted in (("rl: {lr: null}", "rl.lr"), ("model: {name: null}", "model.name"), ("rl: {variant: null}", "rl.variant")):
        p = _yaml(tmp_path, text + "\n")
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: {dotted}: expected .* \(the field is not optional\), got null$"):
            load_config(p)


def test_string_field_refuses_a_number(tmp_path):
    p = _yaml(tmp_path, "model: {name: 12}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: model\.name: expected a string, got 12 \(int\)$"):
        load_config(p)


def test_range_and_name_errors_carry_the_file(tmp_path):
    # __post_init__'s checks, prefixed with the file (they name the field themselves).
    cases = [
        ("rl: {lr: -1}", r"rl\.lr must be > 0"),
        ("data: {on_bad_row: ignore}", r"data\.on_bad_row must be 'error' or 'skip', got 'ignore'"),
        ("rl: {advantage: vtrace}", r"rl\.advantage: unknown advantage estimator 'vtrace'; valid: dr_grpo, gae, grpo"),
        ("rl: {advantage: gae}", r"rl\.advantage 'gae' needs critic values: set ppo\.critic"),
        ("rl: {batch_prompts: 4, group_size: 2, minibatches: 3}", r"rl\.minibatches must divide"),
    ]
    for i, (text, pattern) in enumerate(cases):
        p = _yaml(tmp_path, text + "\n", f"r{i}.yaml")
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: {pattern}"):
            load_config(p)


def test_a_section_must_be_a_mapping_and_an_empty_one_keeps_the_preset(tmp_path):
    p = _yaml(tmp_path, "rl: 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: rl: expected a mapping of RLConfig fields, got 3 \(int\)$"):
        load_config(p)
    # `rl:` with nothing under it: the preset's rl section stays (micro: 4 steps, not the default 150).
    assert merge_yaml(preset("micro"), _yaml(tmp_path, "rl:\nmodel: {init_seed: 3}\n", "empty.yaml")).rl.steps == 4


def test_unparsable_yaml_is_one_line_naming_file_and_line(tmp_path):
    p = _yaml(tmp_path, "rl:\n  steps: 3\n lr: 2\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: not valid YAML at line 3, column 2: ") as err:
        load_config(p)
    assert "\n" not in str(err.value)


def test_with_overrides_checks_like_a_file():
    with pytest.raises(ConfigError, match=r"^overrides: rl\.lr: expected a float, got 'abc' \(str\)$"):
        with_overrides(preset("micro"), rl={"lr": "abc"})
    with pytest.raises(ConfigError, match=r"^overrides: rl\.steps: expected an integer, got 2\.5 \(float\)$"):
        with_overrides(preset("micro"), rl={"steps": 2.5})
    assert with_overrides(preset("micro"), rl={"lr": "3E-5"}).rl.lr == 3e-5


# The checker is generic over field types: a section written today with types no config has yet
# (bools, literals, lists, optional nested sections) is checked without any change to it.
@dataclass(frozen=True)
class _Inner:
    level: int = 1


@dataclass(frozen=True)
class _Future:
    flag: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    ranks: tuple[int, ...] = ()
    inner: _Inner | None = None
    extra: dict[str, float] = field(default_factory=dict)


def test_generic_checker_on_field_types_no_config_has_yet():
    build = config_mod._build
    ok = build(_Future, {"flag": True, "dtype": "bfloat16", "ranks": [0, 1.0], "inner": {"level": 2}, "extra": {"a": "1e-3"}}, "f.yaml")
    assert ok == _Future(True, "bfloat16", (0, 1), _Inner(2), {"a": 1e-3})
    bad = [
        ({"flag": 1}, r"flag: expected true or false, got 1 \(int\)"),
        ({"flag": "yes"}, r"flag: expected true or false, got 'yes' \(str\)"),  # quoted: YAML left it text
        ({"dtype": "fp8"}, r"dtype: expected one of 'float32', 'bfloat16', got 'fp8' \(str\)"),
        ({"ranks": [0, 1.5]}, r"ranks\[1\]: expected an integer, got 1\.5 \(float\)"),
        ({"inner": {"level": "x"}}, r"inner\.level: expected an integer, got 'x' \(str\)"),
        ({"inner": {"depth": 1}}, r"inner: unknown field\(s\) \['depth'\]"),
        ({"extra": {"a": "abc"}}, r"extra\.a: expected a float, got 'abc' \(str\)"),
    ]
    for values, pattern in bad:
        with pytest.raises(ConfigError, match=rf"^f\.yaml[:.] ?{pattern}"):
            build(_Future, values, "f.yaml")


# --- a3po train through the real command line -----------------------------------------------


def _train_cli(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true"}
    cmd = [sys.executable, "-m", "a3po.cli", "train", "--preset", "micro", "--config", str(config), "--output-dir", str(out), "--no-progress"]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rl: {lr: abc}\n", "rl.lr: expected a float, got 'abc' (str)"),
        # Before: accepted, then a TypeError in the RL loop after the warm start had been written.
        ("rl: {steps: 2.5}\n", "rl.steps: expected an integer, got 2.5 (float)"),
    ],
    ids=["lr-abc", "steps-2.5"],
)
def test_cli_train_bad_value_exits_2_in_one_line_and_trains_nothing(tmp_path, text, message):
    p = _yaml(tmp_path, text)
    out = tmp_path / "out"
    proc = _train_cli(p, out)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"a3po train: error: {p}: {message}"]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not out.exists()  # no warm-start cache, no run folder


# --- the flow's command line: --config and --set ----------------------------------------------


def test_flow_set_and_yaml_read_1e_4_alike(tmp_path):
    from flows.cli import parse_sets
    from flows.common import build_config

    overrides, _ = parse_sets(["rl.lr=1e-4"])
    from_set = build_config("micro", overrides=overrides).rl.lr
    from_yaml = build_config("micro", config=str(_yaml(tmp_path, "rl: {lr: 1e-4}\n", "lr.yaml"))).rl.lr
    assert type(from_yaml) is float and from_yaml == from_set == 1e-4
    # and both refuse alike
    bad, _ = parse_sets(["rl.steps=2.5"])
    with pytest.raises(ConfigError, match=r"rl\.steps: expected an integer, got 2\.5 \(float\)"):
        build_config("micro", overrides=bad)


def test_flow_cli_config_error_exits_2_in_one_line(tmp_path, capsys):
    from flows.compare_variants import main

    p = _yaml(tmp_path, "rl: {lr: abc}\n")
    out = tmp_path / "out"
    assert main(["--preset", "micro", "--config", str(p), "--output-dir", str(out), "--benchmarks", ""]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {p}: rl.lr: expected a float, got 'abc' (str)"]
    assert main(["--preset", "micro", "--set", "rl.lr=abc", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: overrides: rl.lr: expected a float, got 'abc' (str)"]
    assert main(["--preset", "micro", "--variants", "sync,fast", "--output-dir", str(out)]) == 2
    assert "rl.variant: expected one of 'sync', 'recompute', 'loglinear', got 'fast'" in capsys.readouterr().err
    assert not out.exists()


# --- datasets: bytes that are not UTF-8 --------------------------------------------------------

GOOD = {"id": "q1", "prompt": "Question: Mia has 3 pens.\nAnswer: ", "gold": "3"}
LINE1 = (json.dumps(GOOD) + "\n").encode()
LINE2 = b'{"prompt": "Question: caf\xe9\\nAnswer: ", "gold": "1"}\n'  # latin-1 e-acute: not UTF-8
LINE3 = (json.dumps({**GOOD, "id": "q3"}) + "\n").encode()
BAD_OFFSET = len(LINE1) + LINE2.index(b"\xe9")  # byte offset of the bad byte in the file


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


@pytest.fixture
def latin1_file(tmp_path) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_bytes(LINE1 + LINE2 + LINE3)
    return p


def test_non_utf8_line_raises_naming_file_row_and_byte(latin1_file):
    with pytest.raises(BadRowError, match=rf"^{re.escape(str(latin1_file))}: row 2: not valid UTF-8 \(byte {BAD_OFFSET} of the file: invalid continuation byte\)$"):
        read_jsonl(latin1_file)


def test_non_utf8_line_is_skipped_and_counted(latin1_file, tok):
    cfg = DataConfig(train_path=str(latin1_file), heldout_path=str(latin1_file), on_bad_row="skip")
    train, held, reports = load_rows(cfg, tok)
    assert [r["id"] for r in train] == [r["id"] for r in held] == ["q1", "q3"]
    rep = reports[0]
    assert (rep.n_rows, rep.n_kept, len(rep.skipped)) == (3, 2, 1)
    assert rep.skipped[0].startswith(f"{latin1_file}: row 2: not valid UTF-8")
    # and in error mode, through the same entry point
    with pytest.raises(BadRowError, match="row 2: not valid UTF-8"):
        load_rows(DataConfig(train_path=str(latin1_file), heldout_path=str(latin1_file)), tok)


def test_a_utf8_byte_order_mark_is_fine(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + LINE1 + LINE3)
    assert [r["id"] for r in read_jsonl(p)] == ["q1", "q3"]


def test_prepare_dataset_reports_the_skipped_row(latin1_file, tmp_path):
    from tasks.data import materialise

    cfg = with_overrides(preset("micro"), data={"train_path": str(latin1_file), "heldout_path": str(latin1_file), "on_bad_row": "skip"})
    prepared = materialise(cfg, tmp_path / "cache")
    assert (prepared.n_train, prepared.n_heldout, prepared.skipped) == (2, 2, 2)  # one per split
    report = json.loads((Path(prepared.train_path).parent / "report.json").read_text())
    assert all("row 2: not valid UTF-8" in s for s in report["skipped_rows"])


def test_benchmark_files_name_the_undecodable_row(tmp_path):
    from eval.data import SchemaError, load_benchmark

    q1 = b'{"question": "1+1?", "answer": "#### 2"}\n'
    bad = b'{"question": "caf\xe9?", "answer": "#### 3"}\n'
    p = tmp_path / "gsm8k.jsonl"
    p.write_bytes(q1 + bad)
    offset = len(q1) + bad.index(b"\xe9")
    with pytest.raises(SchemaError, match=rf"^{re.escape(str(p))}: row 2: not valid UTF-8 \(byte {offset} of the file"):
        load_benchmark("gsm8k", p)
    j = tmp_path / "gsm8k.json"
    j.write_bytes(b'[{"question": "1+1?", "answer": "#### 2"},\n ' + bad.rstrip() + b"]")
    with pytest.raises(SchemaError, match=rf"^{re.escape(str(j))}: line 2: not valid UTF-8"):
        load_benchmark("gsm8k", j)
    p.write_bytes(b"\xef\xbb\xbf" + q1)  # a byte-order mark is fine
    assert [r.gold for r in load_benchmark("gsm8k", p)] == ["2"]
