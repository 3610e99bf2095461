"""Register the nightly convergence-parity deployment (cron ``0 2 * * *``, UTC).

    export PREFECT_API_URL=http://127.0.0.1:4200/api     # infra/start_prefect_server.sh
    python infra/deploy_nightly.py                        # deploy to work pool a3po-local (infra/start_worker.sh runs it)
    python infra/deploy_nightly.py --serve                # or: serve it from this process (no worker needed)
    python infra/deploy_nightly.py --run-now --param preset=micro --param 'seeds=[0]'   # plus one run now

Why a script beside ``infra/prefect.yaml``: ``prefect deploy`` needs the YAML and the CLI;
this does the same from Python, prints what it registered and its next scheduled times, and
ends with one JSON line. Schedules need a real Prefect server (not the temporary one that the
flows start on their own) and a worker polling the pool, or ``--serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

ENTRYPOINT = "flows/nightly_parity.py:nightly_parity"
CRON = "0 2 * * *"


def _param(item: str) -> tuple[str, object]:
    key, _, raw = item.partition("=")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="nightly-parity")
    ap.add_argument("--pool", default=os.environ.get("A3PO_WORK_POOL", "a3po-local"))
    ap.add_argument("--cron", default=CRON)
    ap.add_argument("--timezone", default="UTC")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=JSON", help="flow parameter (repeatable)")
    ap.add_argument("--serve", action="store_true", help="serve from this process instead of deploying to a work pool")
    ap.add_argument("--run-now", action="store_true", help="also create one flow run now")
    args = ap.parse_args(argv)

    from prefect import flow
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("PREFECT_API_URL is not set: schedules need a real server (infra/start_prefect_server.sh)", file=sys.stderr)
        return 2
    params = {"fail_on_regression": True, **dict(_param(p) for p in args.param)}  # a fail verdict fails the flow run
    if args.serve:
        from flows.nightly_parity import nightly_parity

        nightly_parity.serve(name=args.name, cron=args.cron, parameters=params, tags=["a3po", "nightly"])
        return 0

    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.schedules import Cron

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(args.pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=args.pool, type="process"))
    remote = flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    deployment_id = remote.deploy(
        name=args.name,
        work_pool_name=args.pool,
        schedule=Cron(args.cron, timezone=args.timezone),
        parameters=params,
        tags=["a3po", "nightly"],
        job_variables={"working_dir": str(ROOT)},
        print_next_steps=False,
    )
    with get_client(sync_client=True) as client:
        dep = client.read_deployment(deployment_id)
        crons = [s.schedule.cron for s in dep.schedules]
    full_name = f"{remote.name}/{args.name}"
    print(f"deployment {full_name} ({deployment_id}) on pool {args.pool}, cron {crons} {args.timezone}")
    run_id = None
    if args.run_now:
        run = run_deployment(full_name, parameters=params, timeout=0)
        run_id = str(run.id)
        print(f"flow run {run_id} created; a worker on pool {args.pool} will pick it up")
    print(json.dumps({"deployment": full_name, "deployment_id": str(deployment_id), "pool": args.pool, "cron": crons, "flow_run_id": run_id}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
