"""Register a deployment of ``infra/prefect.yaml`` by name, from Python.

    export PREFECT_API_URL=http://127.0.0.1:4200/api            # infra/start_prefect_server.sh
    python infra/deploy.py compare-variants                      # weekly comparison (cron 0 3 * * 0, UTC)
    python infra/deploy.py nightly-parity                        # nightly parity (cron 0 2 * * *, UTC)
    python infra/deploy.py compare-variants --param config=my.yaml --param 'seeds=[0,1,2]' --cron '0 4 * * 1'
    python infra/deploy.py compare-variants --serve              # serve it from this process (no worker)
    python infra/deploy.py compare-variants --run-now --param preset='"micro"'   # plus one run now
    python infra/deploy.py train-one                             # fan-out target (no schedule): pool a3po-train

The deployments are defined once, in ``infra/prefect.yaml`` (entrypoint, cron, timezone, tags,
parameters, work pool); this script registers one of them as written there, with ``--param``
overriding a parameter (JSON, or a bare string) and ``--cron`` / ``--pool`` / ``--name`` the
rest. The comparison flows take one typed parameter, ``spec``: there ``--param KEY=VALUE`` sets
the spec's field KEY (``--param spec=JSON`` replaces the whole spec), and the parameters are
checked against the flow's signature before anything is registered, naming the field.

Why beside ``prefect deploy --prefect-file infra/prefect.yaml``: no CLI prompts, one deployment
at a time, its next runs printed, and one JSON line at the end. Schedules need a real
Prefect server (not the temporary one that the flows start on their own) and a worker polling
the pool (``infra/start_worker.sh``), or ``--serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = ROOT / "infra" / "prefect.yaml"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def deployments(path: Path = PREFECT_YAML) -> dict[str, dict[str, Any]]:
    """The deployments of ``prefect.yaml`` by name (a plain YAML read: nothing in it runs)."""
    return {d["name"]: d for d in yaml.safe_load(path.read_text())["deployments"]}


def _param(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--param expects KEY=VALUE (VALUE as JSON, else a string), got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def flow_parameters(yaml_params: dict[str, Any] | None, overrides: list[str]) -> dict[str, Any]:
    """The deployment's parameters: the YAML's, each ``--param KEY=VALUE`` over them. Where the
    flow takes one typed spec (the YAML's parameters are ``{spec: {...}}``), KEY is a field of
    the spec, so the flags read as they did when the flows took flat parameters."""
    params = {k: dict(v) if isinstance(v, dict) else v for k, v in (yaml_params or {}).items()}
    for key, value in (_param(p) for p in overrides):
        if "spec" in params and key != "spec":
            params["spec"][key] = value
        else:
            params[key] = value
    return params


def parameter_problems(entrypoint: str, params: dict[str, Any]) -> list[str]:
    """Why a run of the flow at ``entrypoint`` with ``params`` would fail before it trains, one line
    per problem (none: it would start): a typo fails here, naming the field, not at 02:00. The
    spec is read as the flow's own command line reads it, strictly (Prefect's check would turn
    ``true`` into 1 for an int field, where the config refuses a bool), then everything the run
    builds first is built: the config (preset, file, overrides), every arm's, the decision rule and
    the launch (the flow module's ``check_spec``), from the checkout's root, where the worker runs
    it. A deployment given no parameters (train-one) takes every one from the run that submits it:
    nothing to check here."""
    import importlib
    import typing

    from pydantic import ValidationError

    if not params:
        return []
    module_path, _, flow_name = entrypoint.partition(":")
    module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
    flow_fn = getattr(module, flow_name).fn
    if set(params) != {"spec"}:
        return [f"parameters {sorted(params)}: the flow takes one, spec"]
    spec_type = typing.get_type_hints(flow_fn)["spec"]
    try:
        built = spec_type.model_validate_json(json.dumps(params["spec"]), strict=True)
    except ValidationError as e:
        return [f"spec.{'.'.join(map(str, err['loc']))}: {err['msg']}, got {err.get('input')!r}" for err in e.errors()]
    here = Path.cwd()
    os.chdir(ROOT)  # a relative config path is read from where the worker runs the flow
    try:
        module.check_spec(built)
    except (ValueError, KeyError, OSError) as e:  # ConfigError, an unknown preset, a missing file
        return [str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)]
    finally:
        os.chdir(here)
    return []


def build_parser(prog: str | None = None, name_default: str | None = None) -> argparse.ArgumentParser:
    known = sorted(deployments())
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    if name_default is None:
        ap.add_argument("deployment", choices=known, help="which deployment of infra/prefect.yaml")
    ap.add_argument("--name", default=None, help="register under this name (default: the YAML's)")
    ap.add_argument("--pool", default=os.environ.get("A3PO_WORK_POOL"), help="work pool (default $A3PO_WORK_POOL, else the YAML's)")
    ap.add_argument("--cron", default=None, help="cron schedule (default: the YAML's)")
    ap.add_argument("--timezone", default=None, help="of the cron (default: the YAML's, UTC)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=JSON", help="flow parameter over the YAML's (repeatable)")
    ap.add_argument("--serve", action="store_true", help="serve from this process instead of deploying to a work pool")
    ap.add_argument("--run-now", action="store_true", help="also create one flow run now")
    return ap


def main(argv: list[str] | None = None, deployment: str | None = None, prog: str | None = None) -> int:
    args = build_parser(prog, deployment).parse_args(argv)
    spec = deployments()[deployment or args.deployment]
    schedule = (spec.get("schedules") or [{}])[0]
    name = args.name or spec["name"]
    pool = args.pool or spec["work_pool"]["name"]
    cron = args.cron or schedule.get("cron")  # None: run on demand only (train-one, the fan-out target)
    timezone = args.timezone or schedule.get("timezone", "UTC")
    params = flow_parameters(spec.get("parameters"), args.param)
    tags = list(spec.get("tags") or [])

    from prefect import flow
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("PREFECT_API_URL is not set: schedules need a real server (infra/start_prefect_server.sh)", file=sys.stderr)
        return 2
    if args.serve:
        served = flow.from_source(source=str(ROOT), entrypoint=spec["entrypoint"])
        served.serve(name=name, cron=cron, parameters=params, tags=tags)
        return 0

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.schedules import Cron

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    remote = flow.from_source(source=str(ROOT), entrypoint=spec["entrypoint"])
    problems = parameter_problems(spec["entrypoint"], params)
    if problems:
        print("\n".join(f"{spec['name']}: {p}" for p in problems), file=sys.stderr)
        return 2
    deployment_id = remote.deploy(
        name=name,
        work_pool_name=pool,
        schedule=Cron(cron, timezone=timezone) if cron else None,
        parameters=params,
        description=spec.get("description"),
        tags=tags,
        job_variables={"working_dir": str(ROOT)},
        print_next_steps=False,
    )
    with get_client(sync_client=True) as client:
        dep = client.read_deployment(deployment_id)
        crons = [s.schedule.cron for s in dep.schedules]
    full_name = f"{remote.name}/{name}"
    print(f"deployment {full_name} ({deployment_id}) on pool {pool}, cron {crons or 'none (on demand)'} {timezone}, parameters {json.dumps(params)}")
    run_id = None
    if args.run_now:
        run = run_deployment(full_name, parameters=params, timeout=0)
        run_id = str(run.id)
        print(f"flow run {run_id} created; a worker on pool {pool} will pick it up")
    print(json.dumps({"deployment": full_name, "deployment_id": str(deployment_id), "pool": pool, "cron": crons,
                      "timezone": timezone, "parameters": params, "flow_run_id": run_id}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
