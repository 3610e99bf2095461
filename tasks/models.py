"""Each arm's final policy as an MLflow logged model, and the nightly candidate's in the registry.

**Where the weights stay.** Training writes the final policy to ``<run_dir>/final`` (a Hugging Face
model folder: about 540 MB for the real model in fp32); its file digests are in the run's
``result.json``. Copying that folder into MLflow's artifact store for every arm, seed and night
would double the disk a comparison takes for nothing a researcher reads there, so each final
policy is an *external* logged model (``mlflow.create_external_model``, MLflow 3's LoggedModel
whose artifacts live outside MLflow; MLflow writes only a small MLmodel stub so the model can be
registered). The model carries the run's parameters, its final metrics (logged with the model's
id, so the Models tab shows them), and the tags that find and check the weights:
``a3po.final_dir`` (the folder) and ``a3po.weights_digest`` (a hash over the folder's file
digests: two models with the same digest are the same weights).

**The registry.** The nightly registers its candidate's final model of each seed as a version of
``a3po-nightly-<preset>-<candidate>`` (tags: the night's verdict, its parent run, the commit, the
seed) and, on a pass only, points the alias ``nightly-pass`` at the first seed's version: the
alias names the weights of the last night that passed. A version whose weights digest is already
registered under that name is not registered again (a re-run that reuses finished runs).

A store that refuses (an older server without logged models, a registry that is not enabled)
costs one warning naming what was not recorded, never the training or the night.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.runtime import run_logger
from tasks.tracking import TrackingRef, client_for

MODEL_TYPE = "a3po-policy"
TAG_DIR = "a3po.final_dir"
TAG_DIGEST = "a3po.weights_digest"
PASS_ALIAS = "nightly-pass"
MAX_PARAM_CHARS = 6000  # a logged model's parameter value, as a run's


def weights_digest(final_files: Mapping[str, str]) -> str:
    """One hash of a final folder's ``{file name: sha256}`` (result.json's ``final_files``)."""
    return hashlib.sha256(json.dumps(dict(sorted(final_files.items())), separators=(",", ":")).encode()).hexdigest()[:32]


def model_name(arm: str, seed: int) -> str:
    """A logged model's name: the arm and seed (MLflow allows ``+`` in it)."""
    return f"{arm}-seed-{seed}"


def registered_name(preset: str, candidate: str) -> str:
    """The nightly's registered model: one per preset and candidate arm (``+`` is not allowed here)."""
    return f"a3po-nightly-{preset}-{candidate}".replace("+", "_")


def final_files(run_dir: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` of a finished run's final folder, as its ``result.json`` records them."""
    path = Path(run_dir) / "result.json"
    files = json.loads(path.read_text()).get("final_files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{path}: no final_files (the digests of the final model's files)")
    return files


def log_final_model(client, run_id: str, arm: str, seed: int, run_dir: str | Path, metrics: Mapping[str, float], step: int) -> str | None:
    """The external logged model of a finished child run (its ``<run_dir>/final``), its ``metrics``
    linked to it; its id, or None (with a warning) where the store refused."""
    import mlflow
    from mlflow.entities import Metric

    final_dir = Path(run_dir) / "final"
    try:
        files = final_files(run_dir)
        run = client.get_run(run_id)
        model = mlflow.create_external_model(
            name=model_name(arm, seed), source_run_id=run_id, experiment_id=run.info.experiment_id, model_type=MODEL_TYPE,
            params={k: v[:MAX_PARAM_CHARS] for k, v in run.data.params.items()},
            tags={TAG_DIR: str(Path(final_dir).resolve()), TAG_DIGEST: weights_digest(files), "a3po.arm": arm, "a3po.seed": str(seed)})
        ts = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), ts, step, model_id=model.model_id) for k, v in metrics.items()])
    except Exception as e:  # noqa: BLE001  (a record, never a reason to lose the run)
        run_logger().warning(f"{arm} seed {seed}: final model not recorded as an MLflow logged model: {type(e).__name__}: {e}")
        return None
    return model.model_id


@task(cache_policy=NO_CACHE)
def register_nightly_candidate(ref: TrackingRef, records: Sequence[dict[str, Any]], preset: str, candidate: str, verdict: str,
                               git_commit: str) -> dict[str, Any]:
    """Register the candidate's final models (one version per seed, not twice for the same
    weights) and, on ``verdict == "pass"``, alias the first seed's ``nightly-pass``.
    ``{"name", "versions": {seed: version}, "alias": version or None}``; {} where refused."""
    client = client_for(ref.tracking_uri)
    name = registered_name(preset, candidate)
    mine = sorted((r for r in records if (r.get("arm") or r["variant"]) == candidate and r.get("model_id")), key=lambda r: r["seed"])
    try:
        if not mine:
            raise ValueError(f"no final model of {candidate} was recorded (see the warnings of its training)")
        try:
            client.get_registered_model(name)
        except Exception:  # noqa: BLE001  (absent: create it)
            client.create_registered_model(name, description=f"The nightly parity candidate {candidate} on {preset}: one version per "
                                                              f"seed and night; alias {PASS_ALIAS}: the last night that passed.")
        have = {v.tags.get(TAG_DIGEST): str(v.version) for v in client.search_model_versions(f"name='{name}'")}
        versions = {}
        for r in mine:
            digest = weights_digest(final_files(Path(r["final_dir"]).parent))
            if digest not in have:
                v = client.create_model_version(name, source=f"models:/{r['model_id']}", run_id=r["mlflow_run_id"], model_id=r["model_id"],
                                                tags={TAG_DIGEST: digest, "nightly.verdict": verdict, "nightly.parent_run": ref.parent_run_id,
                                                      "a3po.git_commit": git_commit, "a3po.seed": str(r["seed"])})
                have[digest] = str(v.version)
            versions[r["seed"]] = have[digest]
        alias = None
        if verdict == "pass":
            alias = versions[mine[0]["seed"]]
            client.set_registered_model_alias(name, PASS_ALIAS, alias)
    except Exception as e:  # noqa: BLE001
        run_logger().warning(f"nightly candidate not registered as {name!r} in the MLflow model registry: {type(e).__name__}: {e}")
        return {}
    return {"name": name, "versions": versions, "alias": alias}


def registry_line(registered: Mapping[str, Any]) -> str:
    """What the night's verdict says of the registry (empty where nothing was registered)."""
    if not registered:
        return ""
    versions = ", ".join(f"seed {s}: version {v}" for s, v in registered["versions"].items())
    alias = (f"; alias {PASS_ALIAS} -> version {registered['alias']}" if registered["alias"] else
             f"; no alias (only a night that passes moves {PASS_ALIAS})")
    return f"\n\nRegistered model {registered['name']}: {versions}{alias}."
