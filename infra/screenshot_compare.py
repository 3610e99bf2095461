"""Screenshot of the MLflow UI's compare-runs page of the newest comparison in a store, taken in
headless Chromium (the picture in docs/pipeline.md), or with ``--completions`` of the newest
run's last completion table (tasks.completions; docs/img/completions_table.png), or with
``--actions`` of the newest run with an actions table: its guard and staleness-bound charts above
the table (tasks.actions; docs/img/guard_actions.png).

    python -m flows.compare_variants --preset micro --variants sync,loglinear --benchmarks '' --output-dir /tmp/shot/runs
    python infra/screenshot_compare.py sqlite:////tmp/shot/mlflow.db docs/img/compare_runs.png

    python -m flows.compare_variants --preset tiny --variants loglinear --steps 30 --set rl.eval_every=15 \
        --benchmarks '' --output-dir /tmp/shot/runs
    python infra/screenshot_compare.py sqlite:////tmp/shot/mlflow.db docs/img/completions_table.png --completions

    python -m flows.compare_variants --preset tiny --variants loglinear --steps 10 --max-staleness 4 --benchmarks '' \
        --set rl.guard_every=1 --set rl.guard_policy=tighten --set rl.schedule=threaded --set rl.lr=0.003 \
        --set rl.lr_warmup_steps=0 --set rl.lr_schedule=constant --set rl.eval_every=5 --output-dir /tmp/shot/runs
    python infra/screenshot_compare.py sqlite:////tmp/shot/mlflow.db docs/img/guard_actions.png --actions --width 1900

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
FOLD_NAV_JS = """
  const nav = document.querySelector('[data-component-id="mlflow_header.toggle_sidebar_button"]');
  if (nav) nav.click();
  const paths = [...document.querySelectorAll('div, span, p')]
    .filter(e => (e.innerText || '').trim().startsWith('Path:') && e.innerText.includes('://'))
    .sort((a, b) => a.innerText.length - b.innerText.length);
  if (paths.length) paths[0].style.visibility = 'hidden';
"""
TABLE_TIDY_JS = "(() => {" + CLOSE_ASSISTANT_JS + FOLD_NAV_JS + """  return Boolean(close);
})()"""
TABLE_TITLE_JS = "document.body.innerText.split('\\n').find(l => l.startsWith('completions/step_'))"
# The actions table (tasks.actions): its rows are on the page; its columns widened to their text (as
# a reader drags them: the view gives each 150 px and cuts the rest), the text wrapped.
ACTIONS_READY_JS = "document.body.innerText.includes('figures') && document.querySelectorAll('[role=cell]').length > 0"
ACTIONS_TIDY_JS = "(() => {" + CLOSE_ASSISTANT_JS + FOLD_NAV_JS + """
  const widths = {step: 44, source: 80, setting: 190, action: 320, reason: 290, figures: 400};
  const headers = [...document.querySelectorAll('[role=columnheader]')].map(h => h.textContent.trim());
  const total = headers.reduce((s, h) => s + (widths[h] || 150), 0);
  document.querySelectorAll('.table-isScrollable').forEach(t => t.style.width = total + 'px');
  document.querySelectorAll('[role=row]').forEach(row => [...row.querySelectorAll('[role=cell],[role=columnheader]')]
    .forEach((c, i) => {
      const w = widths[headers[i]];
      if (!w) return;
      c.style.maxWidth = c.style.minWidth = w + 'px';
      c.style.flex = `0 0 ${w}px`;
      [c, ...c.querySelectorAll('*')].forEach(x => { x.style.whiteSpace = 'normal'; x.style.textOverflow = 'clip'; });
    }));
  return Boolean(close);
})()"""
ACTIONS_TITLE_JS = "document.body.innerText.split('\\n').find(l => l.startsWith('actions.json'))"
ACTIONS_BOTTOM_JS = "Math.max(...[...document.querySelectorAll('[role=table]')].map(e => e.getBoundingClientRect().bottom)) + 16"
# The run's Model metrics tab, its charts filtered (the search box takes a regular expression) to the guard's
# figures and the bound in force.
METRICS_READY_JS = ("Boolean(document.querySelector('input[placeholder=\"Search metric charts\"]')) "
                    "&& document.body.innerText.includes('guard')")
FOCUS_SEARCH_JS = "(() => { const i = document.querySelector('input[placeholder=\"Search metric charts\"]'); i.focus(); return true; })()"
GUARD_CHARTS = "guard/(abs_err_p99|fired|tightened)$|staleness/bound$"
# ... without the charts' zoom toolbars (drawn over the curves in a still picture), through a style that outlives
# the charts drawn again as the filter applies.
METRICS_TIDY_JS = "(() => {" + CLOSE_ASSISTANT_JS + FOLD_NAV_JS + """
  const style = document.createElement('style');
  style.textContent = '.modebar-container { display: none !important; }';
  document.head.appendChild(style);
  return Boolean(close);
})()"""
# drawn: the four charts, and the last one's legend
CHARTS_DRAWN_JS = ("document.querySelectorAll('.js-plotly-plot').length === 4 "
                   "&& document.body.innerText.includes('(staleness/bound)')")
METRICS_TITLE_JS = "document.body.innerText.split('\\n').filter(l => l.endsWith(')') && l.includes('(guard/')).join('; ')"
METRICS_BOTTOM_JS = "Math.max(...[...document.querySelectorAll('.js-plotly-plot')].map(e => e.getBoundingClientRect().bottom)) + 48"


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


def actions_run_path(store: str) -> str:
    """The run-page path (``/#/experiments/<e>/runs/<r>``) of the newest run with an actions table."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exps = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(exps, "tags.`mlflow.loggedArtifacts` LIKE '%actions.json%'", order_by=["attributes.start_time DESC"]):
        return f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    raise SystemExit(f"no run with an actions table in {store}: run a flow whose guard fires (rl.guard_every) first")


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
               title_js: str = TITLE_JS, type_into: tuple[str, str, str] | None = None, bottom_js: str | None = None) -> dict:
    """``type_into``: (a script that focuses an input, the text typed into it, a script true once
    the page has drawn what it then shows), after tidying; ``bottom_js``: where to cut the picture
    (a script returning the page y to keep down to)."""
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
            if type_into is not None:
                focus, text, drawn = type_into
                dt.evaluate(focus)
                dt.call("Input.insertText", text=text)
                while not dt.evaluate(drawn):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the page did not draw what {text!r} selects within {timeout_s:.0f} s: {url}")
                    time.sleep(1)
                time.sleep(3)
            time.sleep(2)
            png = b64decode(dt.call("Page.captureScreenshot", format="png")["data"])
            title = dt.evaluate(title_js)
            bottom = int(dt.evaluate(bottom_js)) if bottom_js else None
        finally:
            dt.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    from PIL import Image  # matplotlib's dependency: a palette PNG is a fraction of the size

    image = Image.open(out).convert("RGB")
    if bottom is not None:
        image = image.crop((0, 0, image.width, min(max(bottom, 1), image.height)))
    image.quantize(colors=256).save(out, optimize=True)
    return {"png": str(out), "bytes": out.stat().st_size, "page_title": title, "closed_assistant": closed_assistant}


def guard_actions(base: str, out: Path, width: int, height: int, timeout_s: float) -> dict:
    """The run at ``base`` (its page's address): its guard and bound charts above its actions table, one PNG."""
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="a3po-shots-") as tmp:
        charts, table = Path(tmp) / "charts.png", Path(tmp) / "table.png"
        metrics = screenshot(f"{base}/model-metrics?workflowType=machine_learning", charts, width, height, timeout_s,
                             ready_js=METRICS_READY_JS, tidy_js=METRICS_TIDY_JS, title_js=METRICS_TITLE_JS,
                             type_into=(FOCUS_SEARCH_JS, GUARD_CHARTS, CHARTS_DRAWN_JS), bottom_js=METRICS_BOTTOM_JS)
        rows = screenshot(f"{base}/artifactPath/actions.json?workflowType=machine_learning", table, width, height, timeout_s,
                          ready_js=ACTIONS_READY_JS, tidy_js=ACTIONS_TIDY_JS, title_js=ACTIONS_TITLE_JS, bottom_js=ACTIONS_BOTTOM_JS)
        top, below = Image.open(charts).convert("RGB"), Image.open(table).convert("RGB")
        both = Image.new("RGB", (width, top.height + 4 + below.height), (200, 200, 200))  # a grey rule between the two
        both.paste(top, (0, 0))
        both.paste(below, (0, top.height + 4))
    out.parent.mkdir(parents=True, exist_ok=True)
    both.quantize(colors=256).save(out, optimize=True)
    return {"png": str(out), "bytes": out.stat().st_size, "size": list(both.size), "charts_shown": metrics["page_title"],
            "table_title": rows["page_title"], "closed_assistant": metrics["closed_assistant"] and rows["closed_assistant"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python infra/screenshot_compare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("store", help="MLflow tracking URI of the store, e.g. sqlite:////tmp/shot/mlflow.db")
    ap.add_argument("out", help="PNG to write, e.g. docs/img/compare_runs.png")
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--height", type=int, default=1700)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for the UI to start and the page to show the runs")
    ap.add_argument("--completions", action="store_true", help="the newest run's last completion table instead of the comparison")
    ap.add_argument("--actions", action="store_true",
                    help="the newest run with an actions table: its guard and staleness-bound charts above the table")
    args = ap.parse_args(argv)

    link = completions_link(args.store) if args.completions else actions_run_path(args.store) if args.actions else compare_link(args.store)
    port = free_port()
    parts = urlsplit(link)
    url = f"http://127.0.0.1:{port}{parts.path or '/'}#{parts.fragment}"
    page = {"ready_js": TABLE_READY_JS, "tidy_js": TABLE_TIDY_JS, "title_js": TABLE_TITLE_JS} if args.completions else {}
    ui = subprocess.Popen(["mlflow", "ui", "--backend-store-uri", args.store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.timeout)
        if args.actions:
            figures = guard_actions(url, Path(args.out), args.width, args.height, args.timeout)
        else:
            figures = screenshot(url, Path(args.out), args.width, args.height, args.timeout, **page)
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
    print(json.dumps({**figures, "url": url}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
