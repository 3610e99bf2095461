"""Bounds that hold whatever the data's and the machine's sizes, non-finite training as a loud
failure, model folders whose code never runs, temporary folders of killed writers swept, and one
line (exit 2) for every model the library cannot use, before anything trains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from a3po.config import ConfigError, preset, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.data.datasets import load_rows

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def _cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """``a3po <argv>`` in this process: its exit status and the lines of stderr that are not warnings."""
    from cli import main

    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.startswith("a3po ") or "Traceback" in line]


def _train_micro(capsys, config: Path, out: Path) -> tuple[int, list[str]]:
    """``a3po train --preset micro --config <config>`` into ``out``, as :func:`_cli`."""
    return _cli(capsys, "train", "--preset", "micro", "--config", str(config), "--output-dir", str(out), "--no-progress")


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


# --- the staleness bound whatever the training set's size -------------------------------------------


def test_a_batch_larger_than_the_generated_training_set_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"rl\.batch_prompts 100 is more than data\.n_train 10"):
        with_overrides(
            preset("micro"), data={"n_train": 10}, rl={"batch_prompts": 100, "max_staleness": 1, "schedule": "threaded"}
        )
    with_overrides(preset("micro"), data={"n_train": 4}, rl={"batch_prompts": 4})  # a batch of the whole set is fine


def test_a_training_file_smaller_than_a_batch_is_refused_naming_it_before_the_warm_start(tmp_path, capsys):
    rows = tmp_path / "two.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "prompt": f"{i} + 1 = ?",
                    "gold": str(i + 1),
                    "solution": f"{i} + 1 = {i + 1}\n#### {i + 1}",
                }
            )
            + "\n"
            for i in range(2)
        )
    )
    cfg = _yaml(tmp_path, f"data: {{train_path: {rows}}}\nrl: {{max_staleness: 1, schedule: threaded}}\n")
    rc, lines = _train_micro(capsys, cfg, tmp_path / "out")
    assert rc == 2 and len(lines) == 1
    assert lines[0] == (
        f"a3po train: error: {rows}: 2 usable training rows, fewer than rl.batch_prompts 4 (each batch draws that "
        "many distinct problems); lower rl.batch_prompts or add rows"
    )
    assert not list((tmp_path / "out").rglob("metrics.jsonl")) and not list((tmp_path / "out").rglob("warmstart-*"))


def test_the_sampler_and_admission_refuse_a_batch_of_another_size_than_the_bound_counts():
    from a3po.models.factory import build_tiny_model
    from a3po.producer.producer import Admission, PromptSampler
    from a3po.producer.weight_store import WeightStore

    _, tok = build_tiny_model("micro", WORDS, seed=0)
    with pytest.raises(ValueError, match=r"3 training rows, fewer than the 4 distinct prompts of a batch"):
        PromptSampler(generate_split(3, "train", 0), tok, batch_prompts=4, group_size=2, seed=0)
    sampler = PromptSampler(generate_split(4, "train", 0), tok, batch_prompts=4, group_size=2, seed=0)
    assert len(sampler.batch(0)[0]) == 8  # every batch is batch_prompts x group_size rows, never cut
    admission = Admission(WeightStore(), max_staleness=1, batch_size=8)
    with pytest.raises(ValueError, match="batch 0 has 6 samples but admission counts batches of 8"):
        admission.admit_batch(0, 6)


def test_a_threaded_run_on_a_set_of_one_batch_keeps_staleness_within_its_bound(core_stub_rewards, core_one_thread):
    from a3po.models.factory import build_tiny_model
    from a3po.training.loop import rl_train

    cfg = with_overrides(
        preset("micro"),
        data={"n_train": 4},
        rl={"batch_prompts": 4, "max_staleness": 1, "schedule": "threaded", "steps": 8, "eval_every": 100},
    )
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, warmstart_acc=0.0)
    assert len(res.history) == 8
    assert max(h["staleness/max"] for h in res.history) <= 1  # the bound (5 was reached with a set cut below the batch)


# --- non-finite training --------------------------------------------------------------------------


def test_an_infinite_gradient_norm_stops_the_run_naming_the_step_and_keeps_the_checkpoints(
    core_stub_rewards, core_one_thread, tmp_path
):
    from a3po.algorithms.checks import NonFiniteError
    from a3po.models.factory import build_tiny_model
    from a3po.storage.checkpoint import load_checkpoint
    from a3po.training.loop import rl_train

    # alpha / r = 1e30 / 8: the adapters' gradient overflows, and clipping would zero every update.
    cfg = with_overrides(preset("micro"), model={"lora": {"alpha": 1e30}}, rl={"checkpoint_every": 1, "steps": 6})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    with pytest.raises(
        NonFiniteError,
        match=r"^step (\d+): non-finite training, policy: the gradient norm is (inf|nan); the run "
        r"stops, its checkpoints hold the steps before \(likely too large: model\.lora\.alpha",
    ) as err:
        rl_train(cfg, model, tok, train, held, ckpt_dir=str(tmp_path), warmstart_acc=0.0)
    step = int(err.value.args[0].split(":")[0].split()[1])
    kept = sorted(tmp_path.glob("step_*"))
    assert [int(p.name[5:]) for p in kept][-1] == step - 1 if kept else step == 1  # every step before it, none after
    for folder in kept:  # intact (hashes checked on load) and finite
        state = load_checkpoint(folder)
        assert all(torch.isfinite(v).all() for v in state["policy"].values())


def test_the_cli_reports_non_finite_training_in_one_line_exit_1(core_stub_rewards, tmp_path, capsys):
    cfg = _yaml(tmp_path, "model: {lora: {alpha: 1.0e30}}\n")
    rc, lines = _train_micro(capsys, cfg, tmp_path / "out")
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("a3po train: step ")
    assert "non-finite training, policy: the gradient norm is" in lines[0] and "model.lora.alpha" in lines[0]


def test_a_warm_start_from_weights_holding_nan_fails_at_its_first_step_and_saves_nothing(core_one_thread):
    from a3po.algorithms.checks import NonFiniteError
    from a3po.models.factory import build_tiny_model
    from a3po.training.warmstart import warm_start

    model, tok = build_tiny_model("micro", WORDS, seed=0)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # a damaged model folder, say
    cfg = preset("micro")
    rows = generate_split(16, "train", 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"^warm-start step 1: non-finite training, warm start: the loss is nan"):
        warm_start(model, tok, rows, cfg.warm_start)
    after = model.state_dict()
    assert all(
        torch.equal(before[k], after[k]) or (before[k].isnan() == after[k].isnan()).all() for k in before
    )  # no step taken


# --- memory bounds from the machine's size --------------------------------------------------------


def _terms(cfg):
    from a3po.models.checks import memory_terms, model_config

    config, model = model_config(cfg.model.name, WORDS)
    return {t.what: t.nbytes for t in memory_terms(cfg, config, model)}, config, model


def test_the_memory_estimate_of_the_micro_preset_is_the_hand_computed_one():
    terms, _, _ = _terms(preset("micro"))
    # rows 4 x 2, seq 96 + 8 tokens, 1 layer, K and V, 2 heads of 16, fp32
    assert terms["the rollout batch's KV cache"] == 8 * 104 * 1 * 2 * 2 * 16 * 4 == 212_992
    # 8 rows / 2 minibatches, 8 new tokens, the vocabulary, fp32 logits
    vocab = terms["a training minibatch's logits"] // (4 * 8 * 4)
    assert terms["a training minibatch's logits"] == 4 * 8 * vocab * 4 and 100 < vocab < 400
    assert terms["the held-out samples"] == 16 * 4 * (64 + 8)  # n_heldout x eval_samples x (overhead + new tokens)


@pytest.mark.parametrize("name", ["micro", "tiny", "tiny-ppo"])
def test_the_presets_pass_the_model_checks(name):
    from a3po.models.checks import check_model

    assert check_model(preset(name), WORDS) == preset(name)


def test_a_smol_sized_model_fits_a_small_laptop():
    from transformers import LlamaConfig

    from a3po.models.checks import check_memory

    # SmolLM2-135M's shapes (the smol preset's model, whose package may not be installed here).
    smol = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(smol)
    cfg = with_overrides(preset("smol"), model={"name": "micro"})  # any name: the shapes come from the model given
    check_memory(cfg, smol, model, total=8 * GIB)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"rl": {"max_new_tokens": 10**8}}, r"rl\.max_new_tokens"),
        ({"rl": {"group_size": 10**7, "minibatches": 2}}, r"rl\.group_size"),
        ({"rl": {"eval_samples": 10**9}}, r"rl\.eval_samples"),
        ({"oppo": {"inter": True, "delta_max": 10**8}}, r"oppo\.delta_max"),
        ({"data": {"max_prompt_tokens": 10**9}}, r"data\.max_prompt_tokens"),
    ],
)  # model.lora.r: bounded by the layers' sides (below), so its adapters never outgrow the model
def test_sizes_that_outgrow_the_memory_are_refused_naming_the_fields(overrides, field):
    from a3po.models.checks import check_memory

    cfg = with_overrides(preset("micro"), **overrides)
    terms, config, model = _terms(cfg)
    with pytest.raises(
        ConfigError, match=f"^[^\n]*{field}[^\n]*: a run needs at least [0-9.e+]+ GiB .* more than the 16 GiB of RAM"
    ):
        check_memory(cfg, config, model, total=16 * GIB)


def test_check_model_uses_this_machines_memory_and_refuses_in_one_line(capsys, tmp_path):
    cfg = _yaml(tmp_path, "rl: {max_new_tokens: 10000000000}\n")  # 10^10 tokens: terabytes of logits on any machine
    rc, lines = _train_micro(capsys, cfg, tmp_path / "out")
    assert (
        rc == 2
        and len(lines) == 1
        and "rl.max_new_tokens: a run needs at least" in lines[0]
        and "of RAM here" in lines[0]
    )
    assert not (tmp_path / "out").exists()


def test_a_lora_rank_above_the_layers_sides_and_targets_that_match_nothing_are_refused():
    from a3po.models.checks import check_lora

    _, _, model = _terms(preset("micro"))
    with pytest.raises(
        ConfigError, match=r"model\.lora\.r 33 exceeds min\(in, out\) = 32 of model\.layers\.0\.self_attn\.q_proj"
    ):
        check_lora(with_overrides(preset("micro"), model={"lora": {"r": 33}}), model)
    with pytest.raises(
        ConfigError,
        match=r"model\.lora\.target_modules \['c_attn'\] match no linear layer of model 'micro'; "
        r"its linear layers are named \['down_proj', 'gate_proj'",
    ):
        check_lora(with_overrides(preset("micro"), model={"lora": {"target_modules": ["c_attn"]}}), model)
    check_lora(with_overrides(preset("micro"), model={"lora": {"r": 32}}), model)


def test_eval_n_samples_beyond_the_memory_is_refused_before_generating(capsys):
    from eval.runner import EvalConfig, check_sample_memory

    with pytest.raises(
        ValueError,
        match=r"n_samples 1000000 \(--n-samples\) x 200 problems of arith: 200000200 completions need "
        r"at least [0-9.]+ GiB, more than the 16 GiB",
    ):
        check_sample_memory("arith", 200, EvalConfig(n_samples=10**6, max_new_tokens=64), total=16 * GIB)
    check_sample_memory("arith", 200, EvalConfig(n_samples=64, max_new_tokens=64), total=16 * GIB)
    from eval.cli import main

    rc = main(["--model", "micro", "--benchmarks", "arith", "--n-samples", str(10**12)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(
        "a3po eval: error: n_samples 1000000000000 (--n-samples) x 200 problems of arith"
    )


# --- model folders and names: no code of theirs runs, one line for what cannot be used ------------------


def _micro_folder(folder: Path) -> Path:
    from a3po.models.factory import build_tiny_model

    model, tok = build_tiny_model("micro", WORDS, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _code_folder(folder: Path, marker: Path) -> Path:
    """A model folder whose config.json names an unknown model type and classes in its own evil.py,
    which writes ``marker`` when imported."""
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evilnet",
                "architectures": ["EvilModel"],
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
            }
        )
    )
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evilnet'\n"
    )
    vocab = {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"}
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": vocab}))
    return folder


def test_the_folders_own_code_never_runs_whatever_is_on_stdin(tmp_path):
    marker = tmp_path / "MARKER"
    folder = _code_folder(tmp_path / "evil", marker)
    # Without the refusal transformers would ask on stdin and run evil.py on 'y' (tested below).
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "eval", "--model", str(folder), "--benchmarks", "arith", "--limit", "1"],
        cwd=REPO,
        input="y\n" * 100,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.strip().splitlines() == [
        f"a3po eval: error: {folder}/config.json: 'auto_map' names code of the folder's own, "
        "which is never run here; use a model whose classes transformers ships"
    ]


def test_the_same_folder_does_run_its_code_when_transformers_is_asked_the_old_way(tmp_path):
    marker = tmp_path / "MARKER"
    folder = _code_folder(tmp_path / "evil", marker)
    probe = (f"from transformers import AutoConfig\ntry:\n    AutoConfig.from_pretrained({str(folder)!r})\n"
             "except Exception:\n    pass\n")
    subprocess.run(
        [sys.executable, "-c", probe],
        input="y\n" * 10,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"),
            "HF_MODULES_CACHE": str(tmp_path / "mods"),
        },
    )
    assert marker.exists()  # the folder above is really malicious: the refusal is what kept it from running


def test_a_tokenizer_config_naming_its_own_code_is_refused_too(tmp_path):
    from a3po.models.factory import ModelFolderError, load_pretrained

    folder = _micro_folder(tmp_path / "m")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tc, "auto_map": {"AutoTokenizer": ["tok.EvilTokenizer", None]}})
    )
    with pytest.raises(ModelFolderError, match=r"tokenizer_config\.json: 'auto_map' names code of the folder's own"):
        load_pretrained(folder)


def test_every_loader_passes_trust_remote_code_false():
    # Every from_pretrained / from_config of the project, found by reading the sources.
    calls = []
    for top in ("a3po", "eval", "tasks", "bench", "flows"):
        for path in (REPO / top).rglob("*.py"):
            text = path.read_text()
            for i, line in enumerate(text.splitlines()):
                if ".from_pretrained(" in line or ".from_config(" in line:
                    call = text.splitlines()[i] + " ".join(text.splitlines()[i + 1 : i + 3])
                    calls.append((f"{path.relative_to(REPO)}:{i + 1}", "trust_remote_code=False" in call))
    assert calls and [where for where, ok in calls if not ok] == []


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "hub",
            r"^a3po train: error: model\.name 'nosuch-org/nosuch-model': model 'nosuch-org/nosuch-model' is not a "
            r"local folder, a built-in architecture \(micro, tiny, small\) or a named model, and it is not in the hub "
            r"cache \(HF_HUB_OFFLINE is set\)$",
        ),
        ("missing", r"^a3po train: error: model\.name '/[^']*/absent': model path /\S*/absent does not exist$"),
        (
            "targets",
            r"^a3po train: error: model\.lora\.target_modules \['nosuch'\] match no linear layer of model 'micro'; ",
        ),
        (
            "pickle",
            r"^a3po train: error: model\.name '[^']*': model folder \S+ holds only pickle weights "
            r"\(pytorch_model\.bin\), "
            r"which can run code when loaded; convert them to safetensors",
        ),
        ("empty", r"^a3po train: error: model\.name '[^']*': model folder \S+ has no weights \(\*\.safetensors\)$"),
    ],
)
def test_models_that_cannot_be_used_are_one_line_exit_2_before_anything_trains(
    case, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = {"hub": "nosuch-org/nosuch-model", "missing": str(tmp_path / "absent"), "targets": "micro"}.get(case)
    if case in ("pickle", "empty"):
        from safetensors.torch import load_file

        folder = _micro_folder(tmp_path / "m")

        weights = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        if case == "pickle":
            torch.save(weights, folder / "pytorch_model.bin")
        model = str(folder)
    lora = "\n  lora: {target_modules: [nosuch]}" if case == "targets" else ""
    cfg = _yaml(tmp_path, f"model:\n  name: {model}{lora}\n")
    t0 = time.perf_counter()
    rc, lines = _train_micro(capsys, cfg, tmp_path / "out")
    assert rc == 2 and len(lines) == 1, lines
    assert re.match(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists() and time.perf_counter() - t0 < 60


def test_a_model_name_that_is_a_file_and_a_reward_model_with_its_own_code_are_refused(tmp_path):
    from a3po.models.checks import check_model

    (tmp_path / "weights.bin").write_bytes(b"not a folder")
    path = tmp_path / "weights.bin"
    with pytest.raises(ConfigError, match=rf"^model\.name '{path}': model path {path} is not a folder$"):
        check_model(with_overrides(preset("micro"), model={"name": str(tmp_path / "weights.bin")}), WORDS)
    marker = tmp_path / "MARKER"
    folder = _code_folder(tmp_path / "rm", marker)
    cfg = with_overrides(preset("tiny-ppo"), ppo={"reward": "model", "reward_model_path": str(folder)})
    refusal = rf"^ppo\.reward_model_path: {folder}/config\.json: 'auto_map' names code of the folder's own"
    with pytest.raises(ConfigError, match=refusal):
        check_model(cfg, WORDS)
    assert not marker.exists()


def test_a_model_cache_under_a_regular_file_is_named_in_one_line(tmp_path, monkeypatch):
    from a3po.models.sources import CACHE_ENV, ModelSourceError, build_folder

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(
        ModelSourceError,
        match=rf"^{CACHE_ENV}={tmp_path}/file/cache: {tmp_path}/file/cache cannot be a folder "
        r"\(it or a parent is a file\)",
    ):
        build_folder(gguf, tmp_path / "file" / "cache" / "m-0", "0" * 64, source="m")


def test_a_truncated_gguf_file_is_named_and_leaves_no_folder(tmp_path):
    from a3po.models.sources import ModelSourceError, build_folder

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)  # the header of a GGUF file, cut short
    with pytest.raises(ModelSourceError, match=rf"^{gguf}: cannot be read as a GGUF model \("):
        build_folder(gguf, tmp_path / "cache" / "m-0", "0" * 64, source="m")
    assert list((tmp_path / "cache").iterdir()) == []


# --- temporary folders of killed writers ----------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_dead_writers_are_swept_by_the_next_write_and_live_ones_kept(tmp_path):
    from a3po.storage.atomic import atomic_write_text, temp_dir_beside

    dead, live = _dead_pid(), os.getppid()
    stale = tmp_path / f".m.tmp-{dead}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\x00" * 1000)
    busy = tmp_path / f".m.tmp-{live}-def"
    busy.mkdir()
    other = tmp_path / f".mm.tmp-{dead}-ghi"  # another folder's leftover: its own next build sweeps it
    other.mkdir()
    tmp = temp_dir_beside(tmp_path / "m")
    assert not stale.exists() and busy.exists() and other.exists() and tmp.name.startswith(f".m.tmp-{os.getpid()}-")
    # Second example: the temporary files of atomic writes (state files, manifests, pointers).
    torn = tmp_path / f".state.json.tmp-{dead}-xyz.tmp"
    torn.write_text("{half")
    atomic_write_text(tmp_path / "state.json", "{}")
    assert not torn.exists() and (tmp_path / "state.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".state.json")] == []


@pytest.mark.parametrize("writer", ["model_cache", "warm_start"])
def test_sigterm_during_a_folder_build_removes_its_temporary_folder(writer, tmp_path):
    out = tmp_path / "cache" / "m-0"
    body = {
        "model_cache": f"""
            import a3po.models.sources as s
            def slow(gguf, tmp):
                (tmp / "model.safetensors").write_bytes(b"0" * 10_000_000)
                print("writing", flush=True)
                time.sleep(60)
            s.convert_gguf = slow
            gguf = Path({str(tmp_path / "m.gguf")!r}); gguf.write_bytes(b"GGUF")
            s.build_folder(gguf, Path({str(out)!r}), "0" * 64, source="m")
        """,
        "warm_start": f"""
            import a3po.training.run as r
            class Slow:
                def save_pretrained(self, tmp):
                    (Path(tmp) / "model.safetensors").write_bytes(b"0" * 10_000_000)
                    print("writing", flush=True)
                    time.sleep(60)
            r.save_pretrained_atomic(Slow(), Slow(), Path({str(out)!r}))
        """,
    }[writer]
    script = "import time\nfrom pathlib import Path\n" + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        # the pid-named folder, being written
        assert [re.match(r"\.m-0\.tmp-(\d+)-", p.name).group(1) for p in out.parent.iterdir()] == [str(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # the signal still ends the process as it would have
    finally:
        proc.kill()
    assert list(out.parent.iterdir()) == []


def test_a_run_folder_that_cannot_fit_on_its_disk_is_refused_before_training(tmp_path):
    from a3po.models.checks import check_disk
    from a3po.models.factory import build_tiny_model

    cfg = with_overrides(preset("micro"), rl={"keep_checkpoints": 2})
    model = build_tiny_model("micro", WORDS, seed=0)[0]
    n = sum(p.numel() for p in model.parameters())
    # fp32: per checkpoint the weights and the newest version (2 x 4n) and AdamW's two moments (8n); the final model 4n.
    need = 2 * (8 * n + 8 * n) + 4 * n
    run_dir = tmp_path / "out" / "loglinear-seed0"
    with pytest.raises(ConfigError, match=rf"^rl.keep_checkpoints: the run folder {re.escape(str(run_dir))} needs at "
                                          r"least .* GiB \(the checkpoints' .*\), more than the .* GiB free there"):
        check_disk(cfg, run_dir, model, free=need - 1)
    check_disk(cfg, run_dir, model, free=need)
    # A resumed run replaces what its folder holds: those bytes count as room.
    run_dir.mkdir(parents=True)
    (run_dir / "old.bin").write_bytes(b"x" * 4096)
    check_disk(cfg, run_dir, model, free=need - 4096)
    with pytest.raises(ConfigError):
        check_disk(cfg, run_dir, model, free=need - 4097)
