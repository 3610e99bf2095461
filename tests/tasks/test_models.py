"""Final policies as MLflow logged models and the nightly candidate in the registry (tasks.models),
on a real MLflow store (SQLite in tmp_path). The flows recording them end to end:
tests/flows/test_compare.py (the Models tab of a comparison) and tests/flows/test_nightly.py."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from tasks.models import PASS_ALIAS, TAG_DIGEST, TAG_DIR, final_files, log_final_model, register_nightly_candidate, registered_name, registry_line
from tasks.tracking import TrackingRef, client_for, create_run, ensure_experiment


def _finished_run(tmp_path: Path, name: str, weights: bytes) -> Path:
    """A run folder as training leaves it: final/ and result.json naming its files' digests."""
    rd = tmp_path / name
    (rd / "final").mkdir(parents=True)
    (rd / "final" / "model.safetensors").write_bytes(weights)
    (rd / "result.json").write_text(json.dumps({"final_files": {"model.safetensors": hashlib.sha256(weights).hexdigest()}}))
    return rd


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    return uri, client, ensure_experiment(client, "models", uri)


def _child(client, exp: str, rd: Path, arm: str, seed: int) -> dict:
    run_id = create_run(client, exp, f"{arm} seed {seed}", {})
    client.log_param(run_id, "rl.lr", "0.003")
    model_id = log_final_model(client, run_id, arm, seed, rd, {"final/reward": 0.5, "final/heldout_acc": 0.25}, step=6)
    return {"arm": arm, "variant": arm.split("+")[0], "seed": seed, "mlflow_run_id": run_id, "model_id": model_id,
            "run_dir": str(rd), "final_dir": str(rd / "final")}


def test_a_finished_run_is_an_external_logged_model_with_its_params_metrics_and_weights(tmp_path, store):
    _, client, exp = store
    rd = _finished_run(tmp_path, "loglinear-seed0", b"weights-a")
    rec = _child(client, exp, rd, "loglinear+oppo-inter", 0)
    (model,) = client.search_logged_models(experiment_ids=[exp])
    assert model.model_id == rec["model_id"] and model.name == "loglinear+oppo-inter-seed-0"
    assert model.source_run_id == rec["mlflow_run_id"] and model.params == {"rl.lr": "0.003"}
    assert model.tags[TAG_DIR] == str((rd / "final").resolve())
    assert model.tags["mlflow.model.isExternal"] == "true"  # the weights stay in the run folder, not copied
    assert {m.key: m.value for m in model.metrics} == {"final/reward": 0.5, "final/heldout_acc": 0.25}
    # The digest is of the files training wrote: other weights, another digest.
    other = _finished_run(tmp_path, "other", b"weights-b")
    assert final_files(other) != final_files(rd)
    assert not list((tmp_path / "mlartifacts").rglob("model.safetensors"))  # nothing copied into the artifact store


def test_a_run_folder_without_its_digests_is_named_and_the_run_goes_on(tmp_path, store, caplog):
    _, client, exp = store
    rd = tmp_path / "broken"
    (rd / "final").mkdir(parents=True)
    (rd / "result.json").write_text("{}")
    run_id = create_run(client, exp, "sync seed 0", {})
    with caplog.at_level(logging.WARNING):
        assert log_final_model(client, run_id, "sync", 0, rd, {"final/reward": 0.1}, step=1) is None
    assert any("final model not recorded" in r.getMessage() and "result.json: no final_files" in r.getMessage() for r in caplog.records)


def test_the_nightly_registers_each_seed_once_and_aliases_only_a_pass(tmp_path, store):
    uri, client, exp = store
    ref = TrackingRef(uri, exp, create_run(client, exp, "nightly-micro", {}))
    night = [_child(client, exp, _finished_run(tmp_path, f"n1-{s}", f"w{s}".encode()), "loglinear", s) for s in (0, 1)]
    night.append(_child(client, exp, _finished_run(tmp_path, "ref", b"r"), "recompute", 0))  # a reference: never registered
    name = registered_name("micro", "loglinear")
    first = register_nightly_candidate.fn(ref, night, "micro", "loglinear", "pass", "abc123")
    assert first == {"name": name, "versions": {0: "1", 1: "2"}, "alias": "1"}
    assert str(client.get_model_version_by_alias(name, PASS_ALIAS).version) == "1"
    assert client.get_model_version(name, "1").tags["nightly.verdict"] == "pass"
    # The same weights again (a re-run reusing the finished runs): no new version.
    assert register_nightly_candidate.fn(ref, night, "micro", "loglinear", "pass", "abc123")["versions"] == {0: "1", 1: "2"}
    assert len(client.search_model_versions(f"name='{name}'")) == 2
    # A failing night with new weights: registered, tagged fail, and the alias stays on the last pass.
    failing = [_child(client, exp, _finished_run(tmp_path, f"n2-{s}", f"v{s}".encode()), "loglinear", s) for s in (0, 1)]
    second = register_nightly_candidate.fn(ref, failing, "micro", "loglinear", "fail", "def456")
    assert second == {"name": name, "versions": {0: "3", 1: "4"}, "alias": None}
    assert client.get_model_version(name, "3").tags["nightly.verdict"] == "fail"
    assert str(client.get_model_version_by_alias(name, PASS_ALIAS).version) == "1"
    assert "no alias (only a night that passes moves nightly-pass)" in registry_line(second)
    assert registry_line(first).endswith(f"seed 0: version 1, seed 1: version 2; alias {PASS_ALIAS} -> version 1.")
    assert all(v.tags[TAG_DIGEST] for v in client.search_model_versions(f"name='{name}'"))


def test_a_registry_that_refuses_costs_a_warning_naming_the_model(tmp_path, store, caplog, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri, client, exp = store
    ref = TrackingRef(uri, exp, create_run(client, exp, "nightly-micro", {}))
    night = [_child(client, exp, _finished_run(tmp_path, "n", b"w"), "loglinear", 0)]

    def refuse(self, *a, **k):
        raise MlflowException("the model registry is not enabled on this server")

    monkeypatch.setattr(MlflowClient, "create_registered_model", refuse)
    with caplog.at_level(logging.WARNING):
        assert register_nightly_candidate.fn(ref, night, "micro", "loglinear", "pass", "abc") == {}
    assert any("not registered as 'a3po-nightly-micro-loglinear'" in r.getMessage() and "not enabled" in r.getMessage()
               for r in caplog.records)
    # No model of the candidate at all (its training could not record one): said, not skipped silently.
    with caplog.at_level(logging.WARNING):
        assert register_nightly_candidate.fn(ref, [{**night[0], "model_id": None}], "micro", "loglinear", "pass", "abc") == {}
    assert any("no final model of loglinear was recorded" in r.getMessage() for r in caplog.records)
