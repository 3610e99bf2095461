"""The command line the comparison flows share: ``--set`` overrides, the options of a
:class:`flows.common.ComparisonSpec`, the launch options, and :func:`run_flow` (the flow's spec
built from the options and checked first, then the Prefect server, then the flow).

Every check that can fail on the user's input runs before the temporary Prefect server starts,
so a typo costs one line on stderr and exit status 2, not a server start-up.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn

import yaml
from pydantic import ValidationError

from a3po.config import PRESETS, load_yaml
from a3po.devices import Device, DType
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from flows.common import ComparisonSpec
from infra.launch import LaunchMode, launch_spec
from tasks.arms import Arm
from tasks.runtime import default_tracking_uri, prefect_api
from tasks.tracking import TrackingUnreachable, probe_tracking

# pydantic error types whose message does not repeat the value given: the line adds it.
_SAYS_NOT_THE_VALUE = {"enum", "literal_error", "int_parsing", "int_from_float", "float_parsing", "bool_parsing",
                       "greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def option_error(err: dict[str, Any]) -> str:
    """One pydantic error of a spec as the line a person reads: the option, what is wrong and the value given."""
    option = "--" + str(err["loc"][0]).replace("_", "-")
    msg = err["msg"].removeprefix("Value error, ")  # a validator's own sentence needs no pydantic prefix
    got = f", got {err['input']!r}" if err["type"] in _SAYS_NOT_THE_VALUE else ""
    return f"{option}: {msg}{got}"


def parse_sets(items: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--set rl.lr=1e-3`` (all variants; ``--set torch_threads=2`` for a top-level field) /
    ``--set loglinear:rl.proximal=metrics`` (one variant, or one arm such as
    ``loglinear+oppo-inter:``; rl fields only). Values are parsed as YAML scalars."""
    overrides: dict[str, Any] = {}
    per_variant: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            usage_error(f"--set expects [variant:]section.field=value, got {item!r}")
        variant, _, dotted = key.rpartition(":")
        section, _, field = dotted.partition(".")
        value = _scalar(raw)
        if not field:  # a top-level field, e.g. torch_threads=2
            if variant:
                usage_error(f"--set {item!r}: per-variant overrides are rl fields only")
            overrides[section] = value
            continue
        if variant:
            if section != "rl":
                usage_error(f"--set {item!r}: per-variant overrides are rl fields only")
            try:
                Arm.parse(variant)  # a variant (all its arms) or one arm, e.g. loglinear+oppo-inter
            except ValueError as e:
                usage_error(f"--set {item!r}: {e}")
            per_variant.setdefault(variant, {})[field] = value
        else:
            overrides.setdefault(section, {})[field] = value
    return overrides, per_variant


def _scalar(raw: str) -> Any:
    """The value as a YAML config file would read it (``1e-3`` is a float there too); the
    config builder then checks it against its field like a file's."""
    try:
        return load_yaml(raw)
    except yaml.YAMLError:
        return raw  # not YAML (e.g. '[1'): the text itself, for the field's check to judge


def usage_error(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as argparse does for a bad option."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def csv(s: str, cast: Callable[[str], Any] = str) -> list:
    """``"0,1,,2"`` -> ``[0, 1, 2]`` with ``cast=int``; empty items are dropped (``""`` -> ``[]``)."""
    return [cast(x) for x in s.split(",") if x.strip()]


def int_csv(s: str, option: str) -> list[int]:
    """:func:`csv` of integers; anything else is a usage error naming ``option`` (not a traceback)."""
    try:
        return csv(s, int)
    except ValueError:
        usage_error(f"{option}: expected comma-separated integers, got {s!r}")


def add_comparison_args(ap: argparse.ArgumentParser, defaults: type[ComparisonSpec]) -> None:
    """The options of a :class:`ComparisonSpec`, with ``defaults``' defaults (each flow its own)."""
    d = defaults.model_fields
    ap.add_argument("--preset", default=d["preset"].default, choices=sorted(PRESETS),
                    help="tiny (learns in minutes on CPU) or micro (seconds; nothing learns)")
    ap.add_argument("--config", help="YAML TrainConfig laid over the preset")
    seeds, benchmarks = (d[k].get_default(call_default_factory=True) for k in ("seeds", "benchmarks"))
    ap.add_argument("--seeds", default=",".join(map(str, seeds)), help="comma-separated RL seeds, e.g. 0,1,2")
    ap.add_argument("--steps", type=int, help="RL steps per run (rl.steps)")
    ap.add_argument("--max-staleness", type=int, help="rl.max_staleness (async variants)")
    ap.add_argument("--checkpoint-every", type=int, help="rl.checkpoint_every: atomic checkpoint period in steps")
    ap.add_argument("--model", help="built-in arch (micro, tiny, small) or a local HF model dir / hub name")
    ap.add_argument("--dataset", help="folder with train.jsonl and heldout.jsonl; default: the embedded task")
    ap.add_argument("--task", help="grading task of --dataset (arith, gsm8k, math500, aime24)")
    ap.add_argument("--set", action="append", default=[], metavar="[VARIANT:]SECTION.FIELD=VALUE", help="config override (repeatable)")
    ap.add_argument("--torch-threads", type=int, default=None, help="config torch_threads (default: the config's, 1)")
    ap.add_argument("--device", choices=[v.value for v in Device], default=None,
                    help="config device (default: the config's, auto); same as --set device=...")
    ap.add_argument("--dtype", choices=[v.value for v in DType], default=None, help="config dtype (default: the config's, float32)")
    ap.add_argument("--benchmarks", default=",".join(benchmarks), help="comma-separated; '' for none")
    ap.add_argument("--bench-limit", type=int, default=d["bench_limit"].default, help="first N problems of each benchmark (0: all)")
    ap.add_argument("--bench-max-new-tokens", type=int, default=d["bench_max_new_tokens"].default)
    ap.add_argument("--data-dir", default=None, help="benchmark files (<dir>/<name>/test.jsonl); default $A3PO_SHARED_DATA or "
                                                      "../shared/data; optional: benchmarks are skipped when absent")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store; default $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db")
    ap.add_argument("--experiment", default=d["experiment"].default)
    ap.add_argument("--output-dir", default=None, help=f"default {defaults.default_output_dir}; re-running with the same dir resumes")
    ap.add_argument("--cache-dir", default=None, help="dataset / warm-start cache; default <output-dir>/cache")
    ap.add_argument("--target-fraction", type=float, default=d["target_fraction"].default)
    ap.add_argument("--smooth-frac", type=float, default=d["smooth_frac"].default)
    ap.add_argument("--system-metrics-interval", type=float, default=d["system_metrics_interval_s"].default,
                    help="seconds between MLflow system-metric samples")
    add_launch_args(ap)


def add_launch_args(ap: argparse.ArgumentParser) -> None:
    """``--launch`` and the LaunchSpec fields (infra.launch; docs/distributed.md)."""
    g = ap.add_argument_group("launch (multi-process training; docs/distributed.md)")
    g.add_argument("--launch", choices=[m.value for m in LaunchMode], default="local",
                   help="local: in-process (default); torchrun / deepspeed: each training runs `python -m a3po.training.command` as launched ranks")
    g.add_argument("--nproc-per-node", type=int, help="torchrun: processes (ranks) per node")
    g.add_argument("--nnodes", type=int, help="torchrun: number of nodes")
    g.add_argument("--node-rank", type=int, help="torchrun: this node's rank (each node runs the command with its own)")
    g.add_argument("--launch-nodes", help="torchrun: comma-separated node ranks started by this command (loopback tests: 0,1)")
    g.add_argument("--master-addr", help="rank 0's host (default 127.0.0.1)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default: a free local port on one node)")
    g.add_argument("--launch-hostfile", help="deepspeed: MPI-style hostfile ('host slots=N' lines), hosts reached by pdsh/ssh")
    g.add_argument("--num-nodes", type=int, help="deepspeed: use the first N hosts of the hostfile")
    g.add_argument("--num-gpus", type=int, help="deepspeed: ranks (GPUs) per host")
    g.add_argument("--launch-include", help="deepspeed: resource filter, e.g. 'node-0@node-1:0,2'")
    g.add_argument("--launch-devices", choices=["cpu", "cuda"], help="device kind the ranks use (recorded; cpu sets DS_ACCELERATOR=cpu)")
    g.add_argument("--zero-stage", type=int, help="ZeRO stage of the DeepSpeed config the ranks use (default: read from "
                                                   "distributed.deepspeed_config; a different value is an error)")


def launch_from_args(args: argparse.Namespace) -> str | dict[str, Any]:
    """The flows' ``launch`` parameter from the flags: the mode name, or a dict of the fields given."""
    fields = {"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes, "node_rank": args.node_rank,
              "nodes": int_csv(args.launch_nodes, "--launch-nodes") if args.launch_nodes else None, "master_addr": args.master_addr,
              "master_port": args.master_port, "hostfile": args.launch_hostfile, "num_nodes": args.num_nodes,
              "num_gpus": args.num_gpus, "include": args.launch_include, "devices": args.launch_devices, "zero_stage": args.zero_stage}
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return args.launch
    spec = {"mode": args.launch, **given}
    try:
        launch_spec(spec)  # a bad combination fails here, naming the field, before any server starts
    except ValueError as e:
        raise SystemExit(f"--launch {args.launch}: {e}") from None
    return spec


def comparison_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of a ComparisonSpec from the options (a flow's spec adds its own)."""
    overrides, per_variant = parse_sets(args.set)
    for key, value in (("device", args.device), ("dtype", args.dtype)):
        if value is not None and overrides.get(key, value) != value:  # given twice: no order between them is natural
            usage_error(f"{key} is given twice, {overrides[key]!r} by --set and {value!r} by --{key}: give it once")
        overrides.update({key: value} if value is not None else {})
    return dict(
        preset=args.preset, config=args.config, model=args.model, dataset=args.dataset, task=args.task, seeds=int_csv(args.seeds, "--seeds"),
        steps=args.steps, max_staleness=args.max_staleness, checkpoint_every=args.checkpoint_every, overrides=overrides or None,
        variant_overrides=per_variant or None, torch_threads=args.torch_threads, benchmarks=csv(args.benchmarks),
        bench_limit=args.bench_limit or None, bench_max_new_tokens=args.bench_max_new_tokens, data_dir=args.data_dir,
        tracking_uri=args.tracking_uri or default_tracking_uri(), experiment=args.experiment, output_dir=args.output_dir,
        cache_dir=args.cache_dir, target_fraction=args.target_fraction, smooth_frac=args.smooth_frac,
        system_metrics_interval_s=args.system_metrics_interval, launch=launch_from_args(args),
    )


def run_flow(name: str, flow: Callable[[Any], dict[str, Any]], spec_type: type[ComparisonSpec], shared: dict[str, Any], own: dict[str, Any],
             check: Callable[[Any], None] = lambda spec: None) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None]:
    """``(exit status, flow result, Prefect API info)`` of ``flow(spec)``, the spec built from
    the shared and the flow's own options, after the checks that need no server: the spec and
    ``check(spec)`` (the configs; a ValueError exits 2), the tracking store's probe (exit 1) and
    the output folder (held by another run: exit 1). Errors are one line on stderr."""
    try:
        spec = spec_type(**shared, **own)
        check(spec)
    except ValidationError as e:  # one line per field, named as its option
        for err in e.errors():
            print(f"error: {option_error(err)}", file=sys.stderr)
        return 2, None, None
    except ValueError as e:  # ConfigError, a spec field, an arm, or a launch that does not fit the config
        print(f"error: {e}", file=sys.stderr)
        return 2, None, None
    try:
        probe_tracking(spec.store())  # a store that is down fails here in seconds, before the server starts
    except TrackingUnreachable as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1, None, None
    # The output folder once (its default may name today's date); refused here, before the
    # Prefect server starts, when another run writes it.
    out = spec.output_folder()
    try:
        with hold_run_folder(out), prefect_api() as api:
            return 0, flow(spec.model_copy(update={"output_dir": str(out)})), api
    except RunFolderBusy as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1, None, None
