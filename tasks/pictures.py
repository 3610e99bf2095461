"""Pictures of one training run, logged on its MLflow child run under ``plots/`` (the run page's
Artifacts tab shows them), drawn from the run's per-step history (``history.jsonl``; metric
definitions in :mod:`a3po.training.metrics`):

- ``staleness_histogram.png``: the run's generated tokens by how many versions behind the
  trainer they were when trained on (``staleness/tokens_<d>``, summed over steps);
- ``importance_weights.png``: per step, the behaviour importance weight ``pi_prox / pi_behav``
  and the trust-region ratio ``pi_theta / pi_prox``, each as logged: mean, p99 and max over the
  step's tokens (``stability/...``);
- ``logprob_error.png``: per step, the engine-vs-trainer log-prob error of the behaviour tokens
  (``rollout/behav_logp_abs_err|_max``) and the loglinear approximation's error
  (``prox/approx_abs_err``), drawn only where a run measured them.

Each figure is drawn by a pure function of the history (a matplotlib Figure, Agg backend, or
None when the run recorded nothing to draw); :func:`log_run_pictures` saves them into the run
folder (``<run_dir>/plots``) and logs them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.runtime import run_logger
from tasks.summary import read_history
from tasks.tracking import TrackingRef, client_for

STALENESS_KEY = re.compile(r"^staleness/tokens_(\d+)$")
LOGP_ERRORS = (("rollout/behav_logp_abs_err", "engine vs trainer, mean"),
               ("rollout/behav_logp_abs_err_max", "engine vs trainer, max"),
               ("prox/approx_abs_err", "loglinear vs recomputed proximal, mean"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def staleness_counts(history: Sequence[dict[str, float]]) -> dict[int, float]:
    """Tokens trained at each staleness ``d`` (versions behind), summed over the run's steps."""
    counts: dict[int, float] = {}
    for h in history:
        for key, n in h.items():
            m = STALENESS_KEY.match(key)
            if m:
                counts[int(m.group(1))] = counts.get(int(m.group(1)), 0.0) + n
    return dict(sorted(counts.items()))


def staleness_figure(history: Sequence[dict[str, float]], title: str):
    counts = staleness_counts(history)
    if not counts:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    total = sum(counts.values()) or 1.0
    ds = list(range(max(counts) + 1))
    ax.bar(ds, [counts.get(d, 0.0) / total for d in ds], color="C0")
    ax.set(xlabel="versions behind the trainer when trained on", ylabel="fraction of trained tokens", xticks=ds,
           title=f"{title}: staleness of trained tokens ({int(total)} tokens)")
    return fig


def weights_figure(history: Sequence[dict[str, float]], title: str):
    names = (("behav_iw", "behaviour IW  pi_prox / pi_behav"),
             ("trust_ratio", "trust-region ratio  pi_theta / pi_prox"))
    if not any(f"stability/{n}_max" in h for h in history for n, _ in names):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [int(h.get("step", i + 1)) for i, h in enumerate(history)]
    for ax, (name, label) in zip(axes, names, strict=True):
        for q, style in (("max", "-"), ("p99", "--"), ("mean", ":")):
            values = [h.get(f"stability/{name}_{q}", float("nan")) for h in history]
            ax.plot(steps, values, ls=style, marker=".", label=q)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set(xlabel="step", ylabel=label, title=f"{label.split('  ')[0]} over the step's tokens")
        ax.legend(fontsize="small")
    fig.suptitle(f"{title}: importance weights and trust region per step")
    fig.tight_layout()
    return fig


def logprob_error_figure(history: Sequence[dict[str, float]], title: str):
    present = [(k, label) for k, label in LOGP_ERRORS if any(k in h for h in history)]
    if not present:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in present:
        pts = [(int(h.get("step", i + 1)), h[key]) for i, h in enumerate(history) if key in h]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=label)
    ax.set(xlabel="step", ylabel="|log-prob difference| (nats per token)", title=f"{title}: log-prob error")
    ax.legend(fontsize="small")
    return fig


FIGURES: dict[str, Callable[[Sequence[dict[str, float]], str], Any]] = {
    "staleness_histogram.png": staleness_figure,
    "importance_weights.png": weights_figure,
    "logprob_error.png": logprob_error_figure,
}


def draw_run_pictures(history: Sequence[dict[str, float]], title: str, out_dir: Path) -> list[Path]:
    """Save every figure the history has data for into ``out_dir``; return the files."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in FIGURES.items():
        fig = draw(history, title)
        if fig is None:
            continue
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


@task(cache_policy=NO_CACHE)
def log_run_pictures(ref: TrackingRef, records: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Each record's pictures into ``<run_dir>/plots`` and onto its child run (``plots/``). A
    failed upload is a warning: the pictures stay in the run folder. Returns run id -> files."""
    client, log, logged = client_for(ref.tracking_uri), run_logger(), {}
    for r in records:
        if not r.get("mlflow_run_id"):
            continue
        title = f"{r.get('arm') or r['variant']} seed {r['seed']}"
        try:  # a fanned-out run's folder may be on another machine's disk
            history = read_history(r["history_path"])
        except OSError as e:
            log.warning(f"no pictures for run {r['mlflow_run_id']}: its history is not readable here ({e})")
            continue
        paths = draw_run_pictures(history, title, Path(r["history_path"]).parent / "plots")
        try:
            for p in paths:
                client.log_artifact(r["mlflow_run_id"], str(p), artifact_path="plots")
        except Exception as e:  # noqa: BLE001 - the comparison stands without its pictures
            log.warning(f"pictures of run {r['mlflow_run_id']} not logged ({type(e).__name__}: {e}); "
                        f"they are in {paths[0].parent}")
            continue
        logged[r["mlflow_run_id"]] = [str(p) for p in paths]
    return logged
