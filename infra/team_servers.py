"""``a3po serve``: the team-mode servers, started by the scripts of ``infra/`` (a thin wrapper).

    a3po serve                 # MLflow on PostgreSQL (infra/start_mlflow_postgres.sh) + the Prefect server
    a3po serve mlflow          # or one of them
    a3po serve --stop          # stop the PostgreSQL that the MLflow script left running

The scripts ship with the source checkout, not with the wheel. They are looked for in
``$A3PO_ROOT/infra`` when ``A3PO_ROOT`` is set (the checkout the Prefect worker runs from, see
``infra/prefect.yaml``), else beside this package (an editable install or a checkout) and in
``./infra``. Both servers run in the foreground until Ctrl-C; when one stops, the other is
stopped too, and so is PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = {"mlflow": "start_mlflow_postgres.sh", "prefect": "start_prefect_server.sh"}
STOP_GRACE_S = 20.0


def infra_dirs() -> list[Path]:
    """Where the scripts may be, in order."""
    root = os.environ.get("A3PO_ROOT")
    if root:  # explicit: only there
        return [Path(root) / "infra"]
    return [Path(__file__).resolve().parents[1] / "infra", Path.cwd() / "infra"]


def find_script(name: str) -> Path:
    """The script ``name`` of ``infra/``; SystemExit(2) naming every place looked in."""
    tried = [d / name for d in infra_dirs()]
    for path in tried:
        if path.is_file():
            return path
    where = ", ".join(str(p) for p in tried)
    print(f"a3po serve: error: {name} not found (looked for {where}); the team-mode scripts come with the "
          f"source checkout, not the wheel: run from a checkout or set A3PO_ROOT to one", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="a3po serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("which", nargs="?", default="all", choices=["all", *SCRIPTS], help="which server(s) (default: all)")
    ap.add_argument("--host", help="bind address of both servers (A3PO_HOST; default 127.0.0.1: they have no authentication)")
    ap.add_argument("--mlflow-port", type=int, help="A3PO_MLFLOW_PORT (default 5000)")
    ap.add_argument("--prefect-port", type=int, help="A3PO_PREFECT_PORT (default 4200)")
    ap.add_argument("--stop", action="store_true", help="only stop PostgreSQL (start_mlflow_postgres.sh --stop)")
    return ap


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for key, val in (("A3PO_HOST", args.host), ("A3PO_MLFLOW_PORT", args.mlflow_port), ("A3PO_PREFECT_PORT", args.prefect_port)):
        if val is not None:
            env[key] = str(val)
    return env


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM each server's process group (the script and what it exec'd or started), then SIGKILL."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs.values():
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a service manager, ``kill``) stops the servers the same way as Ctrl-C."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = _env(args)
    if args.stop:
        return subprocess.call([str(find_script(SCRIPTS["mlflow"])), "--stop"], env=env)
    names = list(SCRIPTS) if args.which == "all" else [args.which]
    scripts = {name: find_script(SCRIPTS[name]) for name in names}  # all found before any starts

    signal.signal(signal.SIGTERM, _interrupt)
    procs: dict[str, subprocess.Popen] = {}
    rc = 0
    try:
        for name, script in scripts.items():
            print(f"a3po serve: starting {name}: {script}", file=sys.stderr, flush=True)
            procs[name] = subprocess.Popen([str(script)], env=env, start_new_session=True)
        while True:
            ended = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
            if ended:
                name, rc = next(iter(ended.items()))
                print(f"a3po serve: {name} exited with status {rc}; stopping the rest", file=sys.stderr, flush=True)
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("a3po serve: stopping", file=sys.stderr, flush=True)
    finally:
        _stop(procs)
        if "mlflow" in procs:  # pg_ctl started PostgreSQL in the background
            subprocess.call([str(scripts["mlflow"]), "--stop"], env=env)
    return rc
