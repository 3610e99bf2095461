"""Links into the MLflow UI (``tasks/links.py``): the URLs for an HTTP server and for a local
store, and the tags on a real parent run in a SQLite store (no Prefect server: the task body
through ``.fn()``). The flows calling it are checked end to end in ``flows/test_compare.py``
and, against a real MLflow server, in ``infra/ci_team_mode.sh``. Secrets in a tracking URI
(``tasks.runtime.mask_uri``) never reach a link, a tag or the printed command. Seconds."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, unquote

import pytest

from a3po.redact import mask_uri
from tasks.links import TAG_COMPARE, TAG_PARENT, TAG_UI_COMMAND, run_links, tag_run_links
from tasks.tracking import TrackingRef, client_for, create_run, ensure_experiment


def _compare_query(url: str) -> dict[str, list[str]]:
    """The run and experiment ids a compare-runs URL names, read the way the UI reads them
    (query after '#/compare-runs?', each value a JSON list)."""
    route, _, query = url.partition("#/compare-runs?")
    assert route and query, url
    return {k: v[0] if k == "workflowType" else json.loads(v[0]) for k, v in parse_qs(query).items()}


def test_links_for_an_http_server_are_on_the_server():
    links = run_links("http://mlflow.lan:5000/", "7", "p123", ["c1", "c2"])
    # The workspace parameter after the '#': the UI's router reads its query there (tasks.links).
    assert links.parent_run == "http://mlflow.lan:5000/#/experiments/7/runs/p123?workflowType=machine_learning"
    assert links.compare_runs == ("http://mlflow.lan:5000/#/compare-runs?runs=%5B%22c1%22%2C%22c2%22%5D&experiments=%5B%227%22%5D"
                                  "&workflowType=machine_learning")
    assert unquote(links.compare_runs).endswith('?runs=["c1","c2"]&experiments=["7"]&workflowType=machine_learning')  # the UI's JSON form
    assert links.ui_command is None


def test_links_for_a_local_store_name_the_command_that_serves_it():
    links = run_links("sqlite:////data/mlflow.db", "1", "p", ["c"])
    assert links.ui_command == "mlflow ui --backend-store-uri sqlite:////data/mlflow.db"
    assert links.parent_run == "http://127.0.0.1:5000/#/experiments/1/runs/p?workflowType=machine_learning"
    assert links.lines()[0] == "start the MLflow UI: mlflow ui --backend-store-uri sqlite:////data/mlflow.db"
    # A database URI's password is never printed or tagged.
    db = run_links("postgresql+psycopg2://a3po:s3cret@db:5432/mlflow", "1", "p", ["c"])
    assert db.ui_command == "mlflow ui --backend-store-uri postgresql+psycopg2://a3po:***@db:5432/mlflow"


def test_parent_run_is_tagged_with_its_own_and_its_childrens_ids(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = ensure_experiment(client, "links", uri)
    parent = create_run(client, exp, "compare-micro", {"a3po.role": "parent"})
    children = [create_run(client, exp, f"v{i}", {"a3po.role": "child"}, parent_run_id=parent) for i in range(3)]
    other = create_run(client, exp, "another flow's run", {"a3po.role": "child"})

    returned = tag_run_links.fn(TrackingRef(uri, exp, parent), children)

    tags = client.get_run(parent).data.tags
    assert tags[TAG_PARENT] == returned["parent_run"] == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{parent}?workflowType=machine_learning"
    assert _compare_query(tags[TAG_COMPARE]) == {"runs": children, "experiments": [exp], "workflowType": "machine_learning"}
    assert other not in tags[TAG_COMPARE]
    assert tags[TAG_UI_COMMAND] == f"mlflow ui --backend-store-uri {uri}"
    # The experiment opens on its runs in MLflow 3's UI, not on the GenAI overview.
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.parametrize("uri, shown", [
    # libpq reads a password from the query string as well as from the userinfo.
    ("postgresql://a3po@db/mlflow?password=s3cret", "postgresql://a3po@db/mlflow?password=***"),
    ("postgresql://a3po:s3cret@db/mlflow?sslmode=require&sslpassword=s3cret&application_name=a3po",
     "postgresql://a3po:***@db/mlflow?sslmode=require&sslpassword=***&application_name=a3po"),
    ("postgresql://a3po:p@ss:w0rd@db:5432/mlflow", "postgresql://a3po:***@db:5432/mlflow"),  # '@' and ':' inside the password
    ("https://mlflow.lan/?access_token=s3cret&X-Amz-Signature=s3cret&api_key=s3cret&page=2",
     "https://mlflow.lan/?access_token=***&X-Amz-Signature=***&api_key=***&page=2"),
    ("mysql://root@db/mlflow?PWD=s3cret", "mysql://root@db/mlflow?PWD=***"),
    # Nothing secret: the URI comes back byte for byte.
    ("sqlite:////data/mlflow.db", "sqlite:////data/mlflow.db"),
    ("postgresql://a3po@db/mlflow?sslmode=require&password=", "postgresql://a3po@db/mlflow?sslmode=require&password="),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
])
def test_mask_uri_hides_passwords_tokens_and_keys_and_keeps_the_rest(uri, shown):
    assert mask_uri(uri) == shown


def test_no_link_tag_or_command_shows_a_secret_of_the_tracking_uri():
    for uri in ("postgresql://a3po@db/mlflow?password=s3cret", "postgresql://a3po:s3cret@db/mlflow?sslpassword=s3cret",
                "https://mlflow.lan/?token=s3cret"):
        links = run_links(uri, "1", "p", ["c"])
        assert all("s3cret" not in line for line in links.lines()), links
        assert "s3cret" not in json.dumps(links.as_dict()), links


def test_a_fanned_out_run_takes_the_secret_from_its_worker_not_from_the_flow_parameters(monkeypatch):
    from flows.train_one import worker_tracking_uri

    store = "postgresql://a3po:s3cret@db/mlflow?sslpassword=s3cret"
    given = mask_uri(store)  # what the comparison puts in the train-one run's parameters
    assert "s3cret" not in given
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert worker_tracking_uri(given) == store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://a3po:s3cret@another-db/mlflow")
    with pytest.raises(ValueError, match=r"a3po:\*\*\*@db/mlflow.*here: postgresql://a3po:\*\*\*@another-db/mlflow") as e:
        worker_tracking_uri(given)
    assert "s3cret" not in str(e.value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(ValueError, match="here: unset"):
        worker_tracking_uri(given)
    assert worker_tracking_uri("http://mlflow.lan:5000") == "http://mlflow.lan:5000"  # nothing secret: used as given
