"""Screenshot of the MLflow UI's compare-runs page of the newest comparison in a store, taken in
headless Chromium (the picture in docs/pipeline.md), or with ``--completions`` of the newest
run's last completion table (tasks.completions; docs/img/completions_table.png).

    python -m flows.compare_variants --preset micro --variants sync,loglinear --benchmarks '' --output-dir /tmp/shot/runs
    python infra/screenshot_compare.py sqlite:////tmp/shot/mlflow.db docs/img/compare_runs.png

    python -m flows.compare_variants --preset tiny --variants loglinear --steps 30 --set rl.eval_every=15 \
        --benchmarks '' --output-dir /tmp/shot/runs
    python infra/screenshot_compare.py sqlite:////tmp/shot/mlflow.db docs/img/completions_table.png --completions

It opens the link the flow tagged on its parent run (``a3po.link.compare_runs``), or the run
page's artifact view of the table, on an ``mlflow ui`` of its own, on a free loopback port, so nothing else is touched. Chromium is
driven over ``--remote-debugging-pipe`` (the DevTools protocol, standard library only) to wait
until the runs are on the page, close MLflow 3.17's assistant panel (it opens by itself on
localhost and would hide half the page) and show only the parameters that differ. The PNG is
reduced to a 256-colour palette to stay small. Needs ``chromium`` (``apt-get install chromium``)
and ``mlflow`` on PATH. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from base64 import b64decode
from pathlib import Path
from urllib.parse import urlsplit

READY_JS = "document.body.innerText.includes('Comparing') && document.body.innerText.includes('Run details')"
TITLE_JS = "document.body.innerText.split('\\n').find(l => l.startsWith('Comparing'))"
# Close the assistant panel; show only the parameters that differ between the runs (the variant).
CLOSE_ASSISTANT_JS = """
  const close = document.querySelector('[data-component-id="mlflow.assistant.chat_panel.close"]')
    || [...document.querySelectorAll('button')].find(b => (b.getAttribute('aria-label') || '').toLowerCase().includes('close')
         && b.closest('div') && b.closest('div').parentElement.innerText.includes('MLflow Assistant'));
  if (close) close.click();
"""
TIDY_JS = """(() => {""" + CLOSE_ASSISTANT_JS + """
  const diffOnly = document.querySelectorAll('[role=switch]');
  if (diffOnly.length) diffOnly[0].click();
  return Boolean(close);
})()"""
# The completion table: its columns are on the page once the artifact has loaded.
TABLE_READY_JS = "document.body.innerText.includes('staleness_max') && document.body.innerText.includes('heldout')"
# ... fold MLflow's navigation sidebar, which takes the width the table's columns need, and blank
# the artifact's storage path (a path of the machine that took the picture).
TABLE_TIDY_JS = "(() => {" + CLOSE_ASSISTANT_JS + """
  const nav = document.querySelector('[data-component-id="mlflow_header.toggle_sidebar_button"]');
  if (nav) nav.click();
  const paths = [...document.querySelectorAll('div, span, p')]
    .filter(e => (e.innerText || '').trim().startsWith('Path:') && e.innerText.includes('://'))
    .sort((a, b) => a.innerText.length - b.innerText.length);
  if (paths.length) paths[0].style.visibility = 'hidden';
  return Boolean(close);
})()"""
TABLE_TITLE_JS = "document.body.innerText.split('\\n').find(l => l.startsWith('completions/step_'))"


def compare_link(store: str) -> str:
    """The compare-runs link tagged on the newest parent run of a comparison in ``store``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        exps, "tags.`a3po.kind` = 'compare' and tags.`a3po.role` = 'parent'", order_by=["attributes.start_time DESC"], max_results=1
    )
    if not runs or "a3po.link.compare_runs" not in runs[0].data.tags:
        raise SystemExit(f"no comparison with an a3po.link.compare_runs tag in {store}: run python -m flows.compare_variants first")
    return runs[0].data.tags["a3po.link.compare_runs"]


def completions_link(store: str) -> str:
    """The run-page path of the last completion table of the newest run that has one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exps = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(exps, "tags.`mlflow.loggedArtifacts` LIKE '%completions/%'", order_by=["attributes.start_time DESC"]):
        tables = sorted(t["path"] for t in json.loads(run.data.tags["mlflow.loggedArtifacts"]) if t["path"].startswith("completions/"))
        return f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/artifactPath/{tables[-1]}"
    raise SystemExit(f"no run with a completion table in {store}: run a flow with rl.log_completions > 0 first")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"timed out waiting for {url}")


class DevTools:
    """The DevTools protocol over Chromium's pipe: JSON messages separated by NUL bytes,
    commands on fd 3, replies and events on fd 4."""

    def __init__(self, chromium: str, width: int, height: int, profile: str) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        os.set_inheritable(to_chrome_r, True)
        os.set_inheritable(from_chrome_w, True)

        def fds() -> None:  # in the child: Chromium reads fd 3 and writes fd 4 (via fds >= 10: no clobbering)
            r, w = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds,  # 3 and 4 stay open after fds(); subprocess closes the rest
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._id, self.session = b"", 0, None

    def call(self, method: str, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise SystemExit("chromium closed the DevTools pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise SystemExit(f"DevTools {method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, js: str):
        return self.call("Runtime.evaluate", expression=js, returnByValue=True).get("result", {}).get("value")

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


def screenshot(url: str, out: Path, width: int, height: int, timeout_s: float, ready_js: str = READY_JS, tidy_js: str = TIDY_JS,
               title_js: str = TITLE_JS) -> dict:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chromium:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="a3po-chromium-") as profile:
        dt = DevTools(chromium, width, height, profile)
        try:
            target = dt.call("Target.createTarget", url="about:blank")["targetId"]
            dt.session = dt.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            dt.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            dt.call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout_s
            while not dt.evaluate(ready_js):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the page did not show its content within {timeout_s:.0f} s: {url}")
                time.sleep(1)
            time.sleep(3)  # charts draw after the data arrives
            closed_assistant = bool(dt.evaluate(tidy_js))
            time.sleep(2)
            png = b64decode(dt.call("Page.captureScreenshot", format="png")["data"])
            title = dt.evaluate(title_js)
        finally:
            dt.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    from PIL import Image  # matplotlib's dependency: a palette PNG is a fraction of the size

    Image.open(out).convert("RGB").quantize(colors=256).save(out, optimize=True)
    return {"png": str(out), "bytes": out.stat().st_size, "page_title": title, "closed_assistant": closed_assistant}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python infra/screenshot_compare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="MLflow tracking URI of the store, e.g. sqlite:////tmp/shot/mlflow.db")
    ap.add_argument("out", help="PNG to write, e.g. docs/img/compare_runs.png")
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--height", type=int, default=1700)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for the UI to start and the page to show the runs")
    ap.add_argument("--completions", action="store_true", help="the newest run's last completion table instead of the comparison")
    args = ap.parse_args(argv)

    link = completions_link(args.store) if args.completions else compare_link(args.store)
    port = free_port()
    parts = urlsplit(link)
    url = f"http://127.0.0.1:{port}{parts.path or '/'}#{parts.fragment}"
    page = {"ready_js": TABLE_READY_JS, "tidy_js": TABLE_TIDY_JS, "title_js": TABLE_TITLE_JS} if args.completions else {}
    ui = subprocess.Popen(["mlflow", "ui", "--backend-store-uri", args.store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.timeout)
        figures = screenshot(url, Path(args.out), args.width, args.height, args.timeout, **page)
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
    print(json.dumps({**figures, "url": url}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
