"""Imports go down the layers (a3po <- eval | infra <- tasks <- flows <- bench <- cli). The import
contracts in pyproject.toml ([tool.importlinter], checked by `lint-imports` in CI) hold the static
layering, one plain stack without exceptions; here is the check they cannot express: a training
run, rewards included, loads no upper layer at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# cli: the `a3po` command, the top of the stack; `a3po train` is the library's own
# a3po.training.command, run here directly, as launched ranks run it.
UPPER_LAYERS = ("cli", "eval", "tasks", "flows", "bench", "infra", "prefect", "mlflow")


WATCH = """
import json, sys, traceback

importers = {}  # top-level upper-layer module -> the file whose import statement first loaded it


class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in UPPER and top not in importers:
            files = [f.filename for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<")]
            importers[top] = files[-1] if files else "<main>"
        return None


UPPER = set(sys.argv[2].split(","))
sys.meta_path.insert(0, Watch())
from a3po.training.command import main

rc = main(["--no-progress", "--preset", "micro", "--output-dir", sys.argv[1]])
print(json.dumps({"rc": rc, "importers": importers, "grader": "a3po.grading" in sys.modules}))
"""


def test_training_with_rewards_loads_no_upper_layer(tmp_path) -> None:
    # A fresh interpreter, so nothing imported by other tests can hide or fake an import.
    script = tmp_path / "watch.py"
    script.write_text(WATCH)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run"), ",".join(UPPER_LAYERS)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict["rc"] == 0 and verdict["grader"]  # it trained, rewards scored by a3po.grading
    assert len((tmp_path / "run" / "loglinear-seed0" / "metrics.jsonl").read_text().splitlines()) == 4
    importers = verdict["importers"]
    # No project module imported an upper layer. Third-party code may import MLflow: with
    # DeepSpeed installed, transformers' save_pretrained loads accelerate -> deepspeed, whose
    # autotuner imports mlflow when present; that is not the library's import.
    # (The project's own files: under the repo, but not the .venv that may live there too.)
    ours = {top: f for top, f in importers.items() if Path(f).resolve().is_relative_to(ROOT) and "site-packages" not in Path(f).parts}
    assert ours == {}
    assert sorted(set(importers) & {"cli", "eval", "tasks", "flows", "prefect"}) == []
