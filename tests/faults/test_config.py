"""Configs and datasets that fail by name.

Config values are checked against their field's type and range when a config is built, and every
error names the file and the dotted field: through the library (``load_config`` / ``merge_yaml`` /
``with_overrides``), through ``a3po train`` in a subprocess (exit 2, one line, nothing trained)
and through the flow's command line (``--config`` and ``--set`` read values alike). Values that
would train nonsense (a clip that reverses updates, groups of one) are refused, hostile YAML
(alias bombs, repeated keys) too; what a config needs of the machine is checked by ``preflight``
where training starts. Dataset lines that are not UTF-8 are named by file, row and byte offset,
or skipped and counted.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import torch

from a3po.config import ConfigError, DataConfig, Variant, load_config, merge_yaml, preflight, preset, with_overrides
from a3po.config import loading as config_loading
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import BadRowError, load_rows, read_jsonl
from a3po.models.tokenizer import build_tokenizer
from a3po.parallel.ranks import Ranks
from a3po.parallel.updaters import DeepSpeedUpdater, LocalUpdater
from a3po.storage.checkpoint import CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[2]
preflight_module = importlib.import_module("a3po.config.preflight")  # the package's `preflight` is the function


def _yaml(tmp_path: Path, text: str, name: str = "bad.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- types of config values (library) --------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("1e-4", 1e-4), ("3E-5", 3e-5), (".5", 0.5), ("'1e-4'", 1e-4), ("1", 1.0)])
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
    expected = r"rl\.variant: expected one of 'sync', 'recompute', 'loglinear', got 'fast' \(str\)$"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: {expected}"):
        load_config(p)
    assert load_config(_yaml(tmp_path, "rl: {variant: sync}\n", "ok.yaml")).rl.variant is Variant.SYNC


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
        ("rl: {lr: -1}", r"rl\.lr must be in \(0, 1\.0\]"),
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
    build = config_loading._build
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


# --- values that build but would train nonsense ------------------------------------------------


@pytest.mark.parametrize("clip", [-1, 0])
def test_a_grad_clip_that_reverses_or_zeroes_updates_is_refused(tmp_path, clip):
    # clip_grad_norm_ scales the gradient by grad_clip / norm: -1 reversed every update, 0 zeroed it.
    p = _yaml(tmp_path, f"rl: {{grad_clip: {clip}}}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: rl\.grad_clip must be > 0 \(0 would zero every update"):
        load_config(p)


def test_grad_clip_null_is_refused_as_not_optional(tmp_path):
    # "No clipping" is a norm no update reaches, not null: the trainer always clips.
    p = _yaml(tmp_path, "rl: {grad_clip: null}\n")
    with pytest.raises(ConfigError, match=r"rl\.grad_clip: expected a float \(the field is not optional\), got null$"):
        load_config(p)


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo"])
def test_groups_of_one_with_a_group_relative_estimator_are_refused(advantage):
    # A group of one is its own mean: every advantage 0, so nothing would be learned.
    expected = rf"rl\.group_size 1 with rl\.advantage '{advantage}': a group-relative estimator needs rl\.group_size >= 2"
    with pytest.raises(ConfigError, match=expected):
        with_overrides(preset("micro"), rl={"group_size": 1, "advantage": advantage})


def test_groups_of_one_are_fine_for_an_estimator_that_is_not_group_relative():
    # GAE compares each token with the critic's value, not with the group.
    cfg = with_overrides(preset("micro"), rl={"group_size": 1, "minibatches": 1, "advantage": "gae"}, ppo={"critic": "policy_copy"})
    assert cfg.rl.batch_prompts * cfg.rl.group_size == 4


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"rl": {"eps_clip": 1e300}}, r"rl\.eps_clip must be in \(0, 1\), got 1e\+300"),
        ({"rl": {"eps_clip": 1.0}}, r"rl\.eps_clip must be in \(0, 1\)"),  # 1 - eps = 0: the lower clip never acts
        ({"rl": {"eps_clip_high": 1e300}}, r"rl\.eps_clip_high must be in \(0, 10\]"),
        ({"rl": {"lr": 5.0}}, r"rl\.lr must be in \(0, 1\.0\]"),
        ({"rl": {"temperature": 1e-9}}, r"rl\.temperature must be in \[0\.01, 100\]"),
        ({"rl": {"seed": -1}}, r"rl\.seed must be in \[0, 2147483647\]"),
        ({"warm_start": {"lr": 1e300}}, r"warm_start\.lr in \(0, 1\.0\]"),
        ({"warm_start": {"seed": 2**40}}, r"warm_start\.seed must be in"),
        ({"model": {"init_seed": -5}}, r"model\.init_seed must be in"),
        ({"data": {"seed": -1}}, r"data\.seed must be in"),
        ({"data": {"n_train": 10**9}}, r"data\.n_train and data\.n_heldout must be in \[1, 1000000\]"),
        ({"data": {"max_add": 0}}, r"data\.max_add must be >= 1 and data\.max_mul >= 2"),
        ({"ppo": {"critic_lr": 3.0}}, r"ppo\.critic_lr must be in \(0, 1\.0\]"),
        ({"ppo": {"kl_coef": 1e300}}, r"ppo\.kl_coef in \[0, 1000\]"),
        # torch segfaulted on it
        ({"torch_threads": 100000}, r"torch_threads must be >= 1, update_threads and generate_threads >= 0, all at most 1024"),
        ({"update_threads": 100000}, r"generate_threads >= 0, all at most 1024 .*got 1, 100000 and 1"),
        ({"generate_threads": 100000}, r"generate_threads >= 0, all at most 1024 .*got 1, 0 and 100000"),
        ({"output_dir": ""}, r"output_dir must be a directory name"),
        ({"distributed": {"deepspeed_config": ""}}, r"distributed\.deepspeed_config is ''"),
    ],
    ids=lambda v: "-".join(f"{k}" for k in v) if isinstance(v, dict) else None,
)
def test_absurd_values_are_refused_when_the_config_is_built(sections, message):
    with pytest.raises(ConfigError, match=rf"^overrides: .*{message}"):
        with_overrides(preset("micro"), **sections)


def test_vllm_with_deepspeed_is_refused_whatever_the_critic():
    # The check sat unreachable under the critic's raise: vllm + DeepSpeed without a critic built.
    expected = r"rollout\.engine 'vllm' with distributed\.deepspeed_config and no rollout workers: every trainer rank would start its own engine"
    with pytest.raises(ConfigError, match=expected):
        with_overrides(preset("micro"), rollout={"engine": "vllm"}, distributed={"deepspeed_config": "infra/deepspeed_zero2.json"})


# --- hostile YAML --------------------------------------------------------------------------------

# Nine levels of nine aliases: 354 bytes that stand for 9**9 (387 million) strings.
BOMB = "data:\n  instruction:\n  - &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"  - &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))

BOMB_PROBE = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # expanding the bomb fails here, not the machine
from a3po.config import ConfigError, load_config
t0 = time.perf_counter()
try:
    load_config(sys.argv[1])
except ConfigError as e:
    print(f"{time.perf_counter() - t0:.3f}", len(str(e)), str(e), sep="\\n")
"""


def test_a_yaml_alias_bomb_is_refused_quickly_without_expanding_it(tmp_path):
    # Before: the type check formatted the value in its error, walking all 9**9 strings (minutes, gigabytes).
    p = _yaml(tmp_path, BOMB)
    assert len(BOMB.encode()) < 410
    proc = subprocess.run([sys.executable, "-c", BOMB_PROBE, str(p)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds, length, message = proc.stdout.strip().splitlines()
    assert float(seconds) < 1.0 and int(length) < 300
    assert message == f"{p}: refused: its aliases expand to more than 100000 YAML nodes (line 8); a config has a few hundred"


def test_aliases_that_stay_small_still_work(tmp_path):
    p = _yaml(tmp_path, "rl: &rl {steps: 3, lr: 1e-4}\nwarm_start: {lr: 1e-3, <<: {steps: 7}}\n")
    cfg = load_config(p)
    assert (cfg.rl.steps, cfg.warm_start.steps, cfg.warm_start.lr) == (3, 7, 1e-3)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("rl: {lr: 1e-4}\nrl: {steps: 3}\n", r"line 2, column 1: duplicate key 'rl' \(first at line 1\)"),
        ("rl:\n  lr: 1e-4\n  steps: 3\n  lr: 0.1\n", r"line 4, column 3: duplicate key 'lr' \(first at line 2\)"),
    ],
    ids=["section", "field"],
)
def test_a_repeated_key_is_refused_naming_it_and_its_lines(tmp_path, text, where):
    # Before: the last one won silently (rl.steps 3 with the default lr; lr 0.1 instead of 1e-4).
    p = _yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: not valid YAML at {where}$"):
        load_config(p)


# --- what a config needs of the machine: preflight, where training starts -----------------------


def test_a_config_naming_deepspeed_builds_without_it_and_preflight_says_how_to_install_it(monkeypatch):
    # The machine that submits a comparison to GPU workers need not have DeepSpeed.
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    cfg = with_overrides(preset("micro"), distributed={"deepspeed_config": "infra/deepspeed_zero2.json"})
    expected = r"^distributed\.deepspeed_config is set but DeepSpeed is not installed: pip install -e '\.\[distributed\]'$"
    with pytest.raises(ConfigError, match=expected):
        preflight(cfg)


def test_preflight_reads_the_deepspeed_json_naming_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr(preflight_module, "deepspeed_available", lambda: True)  # the JSON is checked whether or not it is installed
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"^distributed\.deepspeed_config: {re.escape(str(missing))} does not exist$"):
        preflight(with_overrides(preset("micro"), distributed={"deepspeed_config": str(missing)}))
    stage = tmp_path / "ds.json"
    stage.write_text(json.dumps({"zero_optimization": 2}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(stage))}: 'zero_optimization' must be a JSON object, got 2$"):
        preflight(with_overrides(preset("micro"), distributed={"deepspeed_config": str(stage)}))


def test_config_imports_nothing_above_it():
    # Not even inside a function or under TYPE_CHECKING: the names config checks live in a3po.catalog.
    above = ("a3po.rollout", "a3po.models", "a3po.parallel", "a3po.data", "a3po.producer", "a3po.placement", "a3po.oppo",
             "a3po.training", "a3po.grading", "a3po.storage")
    found = []
    for path in [*sorted((REPO_ROOT / "a3po/config").glob("*.py")), REPO_ROOT / "a3po/catalog.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [(path.name, n) for n in names if n.startswith(above)]
    assert found == []


def test_the_registries_bind_exactly_the_names_the_catalog_declares():
    from a3po.catalog import DECODER_NAMES, MODEL_SOURCE_NAMES, ROLLOUT_ENGINE_NAMES, SAMPLER_NAMES, TASK_NAMES
    from a3po.grading import TASKS
    from a3po.models.decoders import DECODERS
    from a3po.models.sources import MODEL_SOURCES
    from a3po.rollout.engines import ROLLOUT_ENGINES
    from a3po.rollout.sampling import SAMPLERS

    assert ROLLOUT_ENGINES.names() == ROLLOUT_ENGINE_NAMES.names()
    for name in ROLLOUT_ENGINES:
        assert ROLLOUT_ENGINES.get(name).mid_batch_updates is ROLLOUT_ENGINE_NAMES.get(name).mid_batch_updates, name
    assert DECODERS.names() == sorted(DECODER_NAMES)
    assert SAMPLERS.names() == sorted(SAMPLER_NAMES)
    assert TASKS.names() == sorted(TASK_NAMES)
    assert MODEL_SOURCES.names() == MODEL_SOURCE_NAMES.names()


# --- resuming under another DeepSpeed topology --------------------------------------------------


def _deepspeed_updater(world_size: int, stage: int) -> DeepSpeedUpdater:
    # Only the fields the resume check reads: building a real one needs a DeepSpeed launch.
    updater = object.__new__(DeepSpeedUpdater)
    updater.ranks, updater.stage = Ranks(world_size=world_size), stage
    return updater


def test_a_deepspeed_checkpoint_under_another_world_size_is_a_checkpoint_error():
    # Before: an uncaught ValueError, a traceback; a CheckpointError is one line from `a3po train`.
    saved = {"world_size": 2, "zero_stage": 2, "ranks": [{}, {}]}
    expected = r"^the checkpoint's optimizer is partitioned for 2 ranks at ZeRO stage 2; this run has 1 ranks at stage 2$"
    with pytest.raises(CheckpointError, match=expected):
        _deepspeed_updater(world_size=1, stage=2).load_optimizer_state(saved)
    with pytest.raises(CheckpointError, match=r"written by a single-process run; resume it without DeepSpeed"):
        _deepspeed_updater(world_size=2, stage=2).load_optimizer_state({"state": {}, "param_groups": []})
    with pytest.raises(CheckpointError, match=r"written by 2 DeepSpeed ranks at ZeRO stage 2; resume it with the same distributed config"):
        LocalUpdater(torch.nn.Linear(1, 1), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()), 1.0).load_optimizer_state(saved)


# --- a3po train through the real command line -----------------------------------------------


def _train_cli(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true"}
    cmd = [sys.executable, "-m", "a3po.training.command", "--preset", "micro", "--config", str(config), "--output-dir", str(out), "--no-progress"]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rl: {lr: abc}\n", "rl.lr: expected a float, got 'abc' (str)"),
        # Before: accepted, then a TypeError in the RL loop after the warm start had been written.
        ("rl: {steps: 2.5}\n", "rl.steps: expected an integer, got 2.5 (float)"),
        # Before: both failed with a traceback after the warm start had been written.
        ("rl: {max_new_tokens: 0}\n", "rl.max_new_tokens must be >= 1 (a response needs a token), got 0"),
        ("data: {task: gsm9k}\n", "data.task: expected one of 'arith', 'gsm8k', 'math500', 'aime24', got 'gsm9k' (str)"),
    ],
    ids=["lr-abc", "steps-2.5", "max-new-tokens-0", "task-unknown"],
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
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --variants: arm 'fast': rl.variant: expected one of 'sync', 'recompute', 'loglinear', got 'fast' "
        "(an arm is <variant>[+oppo-<mode>][+s<N>|+adaptive[-s<N>]][@<placement>])"
    ]
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
    expected = rf"row 2: not valid UTF-8 \(byte {BAD_OFFSET} of the file: invalid continuation byte\)$"
    with pytest.raises(BadRowError, match=rf"^{re.escape(str(latin1_file))}: {expected}"):
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
