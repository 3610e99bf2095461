"""What a person sees in the MLflow UI after a comparison, checked in headless Chromium (the
``ui`` tier: ``make test-ui``; excluded from the fast tier like ``slow``).

A micro comparison (2 arms, 3 steps, no benchmarks) runs as the command a user types, into a
fresh SQLite store; ``mlflow ui`` serves it on a free loopback port; the links the flow printed
are opened in a fresh Chromium profile (nothing remembered: MLflow keeps the last workspace in
the browser's storage) over the DevTools pipe (infra/screenshot_compare.py), and the test reads
the rendered page:

- the parent run's page is in the "Model training" workspace (its side bar lists the model
  registry, not GenAI's judges and prompts);
- its Description opens with the headline (each arm against its baselines), then the narrow
  comparison table and a link to the full one, the pairs with their intervals, the charts (images
  that loaded) and a link to each child run, in that workspace;
- the compare-runs page lists the child runs;
- a child run's pictures (staleness histogram, importance weights) load as images, and its
  Datasets show the train and held-out files;
- the experiment's Models tab lists each arm's final model;
- in the Prefect UI (the flow ran against a Prefect server started here, not the temporary
  one), the flow run's page shows it Completed, its Artifacts tab lists the verdict, the pairs
  table and the MLflow links, and the verdict and the table open;
- a micro nightly (into the same store) opens its Description with its verdict line, and its
  candidate's model is a version of the registered model.

Screenshots of each page go to ``runs/ui-tests/`` (gitignored; CI keeps them as artifacts).
Needs ``chromium`` (infra/install_chromium.sh; the tests skip, naming it, where it is absent).
About 5 minutes on 2 cores: most of it the two flows and the UIs' start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "runs" / "ui-tests"
WORKSPACE = "workflowType=machine_learning"
# The side bar of the experiment: GenAI's lists judges and prompts, Model training's the registry.
NAV_JS = "[...document.querySelectorAll('nav')].map(n => n.innerText).join('\\n')"
IMAGES_JS = """JSON.stringify([...document.querySelectorAll('img')].filter(i => i.src.includes('%s'))
  .map(i => ({src: i.src, w: i.naturalWidth, done: i.complete})))"""
LINKS_JS = "JSON.stringify([...document.querySelectorAll('a')].map(a => [a.innerText.trim(), a.getAttribute('href')]))"
TABLES_JS = "JSON.stringify([...document.querySelectorAll('table')].map(t => t.innerText))"
# What a person does first: open the folded Description and close the assistant panel MLflow
# opens by itself on localhost (it hides a third of the page).
UNFOLD_JS = """(() => {
  [...document.querySelectorAll('button')].filter(e => e.innerText.trim() === 'Show more').forEach(e => e.click());
  const close = [...document.querySelectorAll('button')]
    .find(b => (b.getAttribute('aria-label') || '').toLowerCase().includes('close') && b.closest('div')
      && b.closest('div').parentElement.innerText.includes('MLflow Assistant'));
  if (close) close.click();
})()"""


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("chromium is not installed: bash infra/install_chromium.sh (make test-ui runs it)")
    return found


@pytest.fixture(scope="module")
def prefect_ui(tmp_path_factory):
    """A Prefect server (API and UI) on a free loopback port, as infra/start_prefect_server.sh
    starts one; yields its address."""
    from infra.screenshot_compare import free_port, wait_http

    _chromium()
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the server must not point at another API
    env.update(PREFECT_HOME=str(tmp_path_factory.mktemp("prefect")), PREFECT_UI_API_URL=f"{address}/api",
               DO_NOT_TRACK="true", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    prefect = str(Path(sys.executable).with_name("prefect"))
    proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"{address}/api/health", 240)
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory, prefect_ui):
    """The links a micro comparison prints, and its store (the flow as a user runs it, against
    the Prefect server ``prefect_ui``)."""
    work = tmp_path_factory.mktemp("ui")
    store = f"sqlite:///{work / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "flows.compare_variants", "--preset", "micro", "--variants", "sync,loglinear",
           "--steps", "3", "--benchmarks", "", "--output-dir", str(work / "runs"), "--tracking-uri", store]
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_API_URL": f"{prefect_ui}/api"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = dict(line.split(":", 1) for line in proc.stdout.splitlines()
                   if line.startswith(("parent run:", "compare runs:")))
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"store": store, "parent": printed["parent run"].strip(), "compare": printed["compare runs"].strip(),
            "figures": figures}


@pytest.fixture(scope="module")
def ui(comparison):
    """``mlflow ui`` on the comparison's store, on a free loopback port; yields its address."""
    from infra.screenshot_compare import free_port, wait_http

    port = free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    proc = subprocess.Popen([mlflow, "ui", "--backend-store-uri", comparison["store"], "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 240)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


class Page:
    """One Chromium tab in a fresh profile, driven over the DevTools pipe."""

    def __init__(self, devtools) -> None:
        self.dt = devtools
        target = devtools.call("Target.createTarget", url="about:blank")["targetId"]
        devtools.session = devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        devtools.call("Emulation.setDeviceMetricsOverride", width=1400, height=1800, deviceScaleFactor=1, mobile=False)

    def open(self, url: str, ready_js: str, timeout_s: float = 120) -> str:
        """Navigate; wait until ``ready_js`` is true (and a little for images); the page's text."""
        self.dt.call("Page.navigate", url="about:blank")  # a full load each time, not a hash change within the app
        self.dt.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.dt.evaluate(ready_js):
            if time.monotonic() > deadline:
                text = self.dt.evaluate("document.body ? document.body.innerText : ''") or ""
                raise AssertionError(f"{url} did not show what was awaited ({ready_js}) in {timeout_s:.0f} s; "
                                     f"it shows:\n{text[:2000]}")
            time.sleep(1)
        self.dt.evaluate(UNFOLD_JS)
        time.sleep(3)
        return self.dt.evaluate("document.body.innerText")

    def click_until(self, label: str, ready_js: str, timeout_s: float = 60) -> str:
        """Click the element whose own text is ``label`` (a tab), as a person would; wait until
        ``ready_js`` is true; the page's text."""
        click = f"""(() => {{ const el = [...document.querySelectorAll('button, a, [role=tab], li, span')]
          .find(e => e.innerText && e.innerText.trim() === {json.dumps(label)}); if (el) el.click(); return !!el; }})()"""
        deadline = time.monotonic() + timeout_s
        while not (self.dt.evaluate(click) and self._wait(ready_js, 5)):
            if time.monotonic() > deadline:
                text = self.dt.evaluate("document.body.innerText") or ""
                raise AssertionError(f"clicking {label!r} did not show what was awaited ({ready_js}); the page shows:\n{text[:2000]}")
        time.sleep(2)
        return self.dt.evaluate("document.body.innerText")

    def _wait(self, ready_js: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.dt.evaluate(ready_js):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def js(self, expression: str):
        value = self.dt.evaluate(expression)
        return json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value

    def screenshot(self, name: str) -> Path:
        from base64 import b64decode

        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / name
        path.write_bytes(b64decode(self.dt.call("Page.captureScreenshot", format="png")["data"]))
        return path


@pytest.fixture(scope="module")
def page(ui):
    from infra.screenshot_compare import DevTools

    with tempfile.TemporaryDirectory(prefix="a3po-ui-profile-") as profile:
        dt = DevTools(_chromium(), 1400, 1800, profile)
        try:
            yield Page(dt)
        finally:
            dt.close()


def on(ui: str, link: str) -> str:
    """A printed link (``mlflow ui``'s default address) on the UI this test started."""
    parts = urlsplit(link)
    return f"{ui}{parts.path or '/'}#{parts.fragment}"


def _children(comparison) -> list[tuple[str, str, str]]:
    """``(run name, experiment id, run id)`` of each child run, by name."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(comparison["store"])
    parent = client.get_run(comparison["figures"]["parent_run_id"])
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return sorted((r.info.run_name, r.info.experiment_id, r.info.run_id) for r in runs)


def test_the_printed_links_open_the_model_training_workspace(comparison, ui, page):
    page.open(on(ui, comparison["parent"]), "document.body.innerText.includes('Description')")
    nav = page.js(NAV_JS)
    page.screenshot("parent_run.png")
    assert "Model registry" in nav and "Judges" not in nav, \
        f"{comparison['parent']} is not in the Model training workspace; side bar:\n{nav}"
    # The compare page has no side bar: its link is checked as the UI reads it (the query after '#').
    for link in (comparison["parent"], comparison["compare"]):
        query = urlsplit(link).fragment.partition("?")[2]
        assert WORKSPACE in query.split("&"), f"{link}: no {WORKSPACE} in the query after '#'"


def test_the_parent_run_description_shows_the_comparison_charts_and_child_runs(comparison, ui, page):
    ready = "['No description', 'Child runs'].some(t => document.body.innerText.includes(t))"
    text = page.open(on(ui, comparison["parent"]), ready)
    assert "No description" not in text, "the parent run's Description is empty"
    tables = page.js(TABLES_JS)
    assert any("final reward" in t and "held-out acc" in t and "loglinear" in t and "sync" in t for t in tables), \
        f"no comparison table in the Description; tables on the page: {tables}"
    assert any("step-time ratio [lo, hi]" in t and "loglinear vs sync" in t for t in tables), \
        f"no pairs table in the Description; tables on the page: {tables}"
    hrefs = [href or '' for _, href in page.js(LINKS_JS)]
    for name, _, run_id in _children(comparison):
        assert any(run_id in href and WORKSPACE in href for href in hrefs), \
            f"no link to child run {name} ({run_id}): {hrefs}"
    charts = page.js(IMAGES_JS % "get-artifact")
    assert len(charts) == 2 and all(c["w"] > 0 for c in charts), f"the Description's charts did not load: {charts}"
    page.screenshot("parent_run_description.png")


def test_the_compare_page_lists_the_child_runs(comparison, ui, page):
    text = page.open(on(ui, comparison["compare"]), "document.body.innerText.includes('Comparing')")
    names = [name for name, _, _ in _children(comparison)]
    page.screenshot("compare_runs.png")
    assert f"Comparing {len(names)}" in text and all(n in text for n in names), text[:1500]


@pytest.mark.parametrize("picture", ["staleness_histogram.png", "importance_weights.png"])
def test_a_child_runs_pictures_are_shown(comparison, ui, page, picture):
    name, exp, run_id = _children(comparison)[0]
    url = f"{ui}/#/experiments/{exp}/runs/{run_id}/artifactPath/plots/{picture}?{WORKSPACE}"
    # The artifact view draws the file it fetched as a blob: image under the file's name.
    shown = f"document.body.innerText.includes('plots/{picture}')"
    drawn = "[...document.querySelectorAll('img')].some(i => i.src.startsWith('blob:') && i.naturalWidth > 0)"
    page.open(url, f"{shown} && {drawn}", timeout_s=60)
    images = page.js(IMAGES_JS % "blob:")
    page.screenshot(f"child_{picture}")
    assert images and images[0]["w"] > 0, f"{picture} of {name} did not load: {images}"


def test_the_prefect_ui_shows_the_flow_run_completed(comparison, prefect_ui, page):
    from mlflow.tracking import MlflowClient

    parent = MlflowClient(comparison["store"]).get_run(comparison["figures"]["parent_run_id"])
    flow_run = parent.data.tags["prefect.flow_run_id"]  # the parent run names its Prefect flow run
    text = page.open(f"{prefect_ui}/runs/flow-run/{flow_run}", "document.body.innerText.includes('Completed')")
    page.screenshot("prefect_flow_run.png")
    assert "compare-variants" in text, text[:1500]


@pytest.fixture(scope="module")
def night(tmp_path_factory, prefect_ui, comparison):
    """A micro nightly as a user runs it (one seed, 3 steps: not measurable, exit 1), against
    ``prefect_ui``, into the comparison's store."""
    work = tmp_path_factory.mktemp("ui-night")
    store = comparison["store"]  # one store: the UI started for the comparison shows the night too
    cmd = [sys.executable, "-m", "flows.nightly_parity", "--preset", "micro", "--seeds", "0", "--steps", "3", "--references", "recompute",
           "--benchmarks", "", "--output-dir", str(work / "runs"), "--tracking-uri", store, "--n-boot", "200"]
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_API_URL": f"{prefect_ui}/api"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"store": store, "figures": figures, "parent": figures["parent_run_url"]}


def _flow_run_of(store: str, parent_run_id: str) -> tuple[str, str]:
    from mlflow.tracking import MlflowClient

    parent = MlflowClient(store).get_run(parent_run_id)
    return parent.data.tags["prefect.flow_run_id"], parent.info.experiment_id


def _artifact_ids(api: str, flow_run: str) -> dict[str, str]:
    """The flow run's artifacts by key, read over the server's REST API: this process imported
    Prefect earlier, and its settings (the API address) were fixed then."""
    from urllib.request import Request, urlopen

    body = json.dumps({"artifacts": {"flow_run_id": {"any_": [flow_run]}}}).encode()
    request = Request(f"{api}/artifacts/filter", data=body, headers={"Content-Type": "application/json"})
    with urlopen(request, timeout=30) as response:
        return {a["key"]: a["id"] for a in json.load(response)}


def test_the_prefect_flow_run_shows_its_artifacts_the_verdict_and_the_pairs_table(comparison, prefect_ui, page):
    flow_run, _ = _flow_run_of(comparison["store"], comparison["figures"]["parent_run_id"])
    key = "compare-micro-a3po-compare"
    page.open(f"{prefect_ui}/runs/flow-run/{flow_run}", "document.body.innerText.includes('Artifacts')")
    text = page.click_until("Artifacts", f"document.body.innerText.includes('{key}-pairs')")
    page.screenshot("prefect_flow_run_artifacts.png")
    for suffix in ("verdict", "pairs", "mlflow-parent", "mlflow-compare"):
        assert f"{key}-{suffix}" in text, f"artifact {key}-{suffix} not on the flow run's Artifacts tab:\n{text[:2000]}"
    ids = _artifact_ids(f"{prefect_ui}/api", flow_run)
    verdict = page.open(f"{prefect_ui}/artifacts/artifact/{ids[f'{key}-verdict']}", "document.body.innerText.includes('loglinear')")
    page.screenshot("prefect_artifact_verdict.png")
    assert "compare-micro: 2 arms x seeds 0" in verdict and "not settled" in verdict, verdict[:2000]
    table = page.open(f"{prefect_ui}/artifacts/artifact/{ids[f'{key}-pairs']}", "document.body.innerText.includes('loglinear vs sync')")
    page.screenshot("prefect_artifact_pairs.png")
    assert "step-time ratio verdict" in table, table[:2000]


def test_the_models_tab_lists_each_arms_final_model(comparison, ui, page):
    _, exp = _flow_run_of(comparison["store"], comparison["figures"]["parent_run_id"])
    text = page.open(f"{ui}/#/experiments/{exp}/models?{WORKSPACE}", "document.body.innerText.includes('loglinear-seed-0')")
    page.screenshot("mlflow_models_tab.png")
    assert "sync-seed-0" in text and "loglinear-seed-0" in text, text[:2000]


def test_a_child_run_shows_the_data_it_trained_and_was_evaluated_on(comparison, ui, page):
    name, exp, run_id = _children(comparison)[0]
    text = page.open(f"{ui}/#/experiments/{exp}/runs/{run_id}?{WORKSPACE}", "document.body.innerText.includes('train.jsonl')")
    page.screenshot("child_run_datasets.png")
    assert "heldout.jsonl" in text, f"{name}: the held-out set is not among the run's datasets:\n{text[:2000]}"


def test_the_description_opens_with_the_headline_and_the_nightly_with_its_verdict(comparison, night, ui, page):
    ready = "document.body.innerText.includes('Child runs')"
    text = page.open(on(ui, comparison["parent"]), ready)
    page.screenshot("parent_run_description_headline.png")
    body = text[text.index("Description"):]
    # The headline (each arm against its baselines, the verdict its interval allows) before any table.
    assert body.index("loglinear:") < body.index("final reward") < body.index("Full comparison table"), body[:2000]
    night_text = page.open(on(ui, night["parent"]), ready)
    page.screenshot("nightly_description.png")
    verdict = night["figures"]["verdict"].upper()
    first = [line.strip() for line in night_text[night_text.index("Description"):].splitlines() if line.strip()]
    assert f"Nightly parity: {verdict}" in first[:4], first[:10]
    # The night's candidate, registered: its version is on the registered model's page.
    name = "a3po-nightly-micro-loglinear"
    model = page.open(f"{ui}/#/models/{name}?{WORKSPACE}", "document.body.innerText.includes('Version 1')")
    page.screenshot("nightly_registered_model.png")
    assert name in model, model[:2000]
