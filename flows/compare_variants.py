"""Compare the variants (sync, recompute, loglinear) end to end, tracked in MLflow.

    python -m flows.compare_variants                      # tiny preset, all three variants
    python -m flows.compare_variants --preset micro       # seconds: plumbing only, nothing learns
    python -m flows.compare_variants --variants loglinear,recompute --seeds 0,1 --steps 60
    python -m flows.compare_variants --variants loglinear --oppo off,inter --set data.long_tail_frac=0.25 --set rl.max_new_tokens=64

The pipeline, one line per task:

    prepare dataset (cached) -> warm start (cached) -> for each variant x seed:
    train (atomic checkpoints every N steps; resumes when re-run) -> evaluate the final
    checkpoint (in-domain held-out; GSM8K / MATH500 / AIME24 when their files exist)
    -> summary (table, speedups, plots) on the MLflow parent run

A variant killed mid-training resumes from its last checkpoint when the flow is run again with
the same output dir. Variants run one after another (the machine this targets has 2 cores).

Embedded default: Prefect's temporary local server (state under ./.prefect) and an MLflow
SQLite store ./mlflow.db (override with MLFLOW_TRACKING_URI or --tracking-uri); team mode:
set PREFECT_API_URL and MLFLOW_TRACKING_URI to the servers started by infra/. Prints the
comparison table, how to open the MLflow UI, and, as its last line, one JSON object of key
figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import yaml
from prefect import flow, get_run_logger

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import PRESETS, TrainConfig, Variant, config_to_dict, load_yaml, merge_yaml, preflight, with_overrides
from a3po.config import preset as load_preset
from a3po.devices import Device, DType
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from flows.train_one import fan_out, spec_to_dict, train_and_evaluate
from infra.launch import LaunchMode, LaunchSpec, launch_spec
from tasks.arms import OPPO_MODES, arm_config, arm_name, expand_arms, parse_arm
from tasks.data import dataset_ready, prepare_dataset, with_prepared_data
from tasks.evaluation import BENCHMARKS
from tasks.links import RunLinks, tag_run_links
from tasks.runtime import default_tracking_uri, prefect_api
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION, summarise
from tasks.tracking import TrackingRef, close_parent_run, log_to_parent, open_parent_run
from tasks.training import launch_for_config, run_dir_for, topology_tags, warm_start, warmstart_ready

DEFAULT_VARIANTS = [v.value for v in Variant]  # sync, recompute, loglinear


def default_data_dir() -> str:
    """Benchmark files: ``$A3PO_SHARED_DATA`` or ``../shared/data``; absent is fine (skipped)."""
    return os.environ.get("A3PO_SHARED_DATA") or str(Path.cwd().parent / "shared" / "data")


def build_config(
    preset: str,
    config: str | None = None,
    model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    steps: int | None = None,
    max_staleness: int | None = None,
    checkpoint_every: int | None = None,
    overrides: dict[str, Any] | None = None,
    torch_threads: int | None = None,
) -> TrainConfig:
    """The base config of a comparison: preset, then YAML, then explicit values (invalid
    combinations raise here, before anything runs)."""
    cfg = load_preset(preset)
    if config:
        cfg = merge_yaml(cfg, config)
    sections: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (overrides or {}).items()}
    if model:
        sections.setdefault("model", {})["name"] = model
    if dataset:
        d = Path(dataset)
        sections.setdefault("data", {}).update({"train_path": str(d / "train.jsonl"), "heldout_path": str(d / "heldout.jsonl")})
    if task:
        sections.setdefault("data", {})["task"] = task
    rl = sections.setdefault("rl", {})
    for key, val in (("steps", steps), ("max_staleness", max_staleness), ("checkpoint_every", checkpoint_every)):
        if val is not None:
            rl[key] = val
    if torch_threads:
        sections["torch_threads"] = torch_threads
    return with_overrides(cfg, **sections)


def output_folder(preset: str, output_dir: str | None) -> Path:
    """The comparison's folder; '{date}' gives each scheduled run its own (a re-run the same day resumes, like nightly's)."""
    return Path((output_dir or f"runs/compare-{preset}").replace("{date}", f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}")).resolve()


def variant_config(base: TrainConfig, arm: str, seed: int, variant_overrides: dict[str, dict[str, Any]] | None) -> TrainConfig:
    """The config of one arm (a variant, or ``<variant>+oppo-<mode>``: tasks.arms) and seed;
    ``variant_overrides`` keyed by the variant apply to all its arms, keyed by the arm to that one."""
    vo = variant_overrides or {}
    variant, _ = parse_arm(arm)
    return arm_config(base, arm, seed, {**vo.get(variant, {}), **(vo.get(arm, {}) if arm != variant else {})})


def run_comparison(
    base: TrainConfig,
    tracking: TrackingRef,
    output_dir: Path,
    cache_dir: Path,
    variants: list[str],
    seeds: list[int],
    variant_overrides: dict[str, dict[str, Any]] | None,
    benchmarks: list[str],
    data_dir: str | None,
    bench_limit: int | None,
    bench_max_new_tokens: int,
    system_metrics_interval_s: float,
    launch: LaunchSpec | None = None,
    fanout_deployment: str | None = None,
) -> list[dict[str, Any]]:
    """The comparison body shared by the flows: one record per variant x seed. ``launch`` (not
    local): each training runs as ranks of ``python -m a3po.cli train`` (tasks.training.train_launched).
    ``fanout_deployment``: each variant x seed runs as a run of that ``train-one`` deployment,
    all submitted at once, on the workers of its pool (flows.train_one); else here, in turn.
    ``variants`` are arms (tasks.arms): ``loglinear``, ``loglinear+oppo-inter``, ...; each record's
    ``arm`` is the name of the config that ran (tasks.arms.arm_name)."""
    # Cached by input hashes; a cache folder deleted by hand refreshes the record instead.
    data = prepare_dataset.with_options(refresh_cache=not dataset_ready(base, cache_dir))(base, str(cache_dir))
    base = with_prepared_data(base, data)
    ws = warm_start.with_options(refresh_cache=not warmstart_ready(base, cache_dir))(base, str(cache_dir))
    get_run_logger().info(f"dataset {data.key}: {data.n_train} train / {data.n_heldout} held-out rows; warm-start held-out acc {ws.heldout_acc:.3f}")
    jobs = [(cfg, str(run_dir_for(output_dir, cfg))) for cfg in
            (variant_config(base, variant, seed, variant_overrides) for variant in variants for seed in seeds)]
    if fanout_deployment:
        return fan_out(fanout_deployment, [
            (f"{arm_name(cfg)} seed {cfg.rl.seed}", run_dir, dict(
                config=config_to_dict(cfg), run_dir=run_dir, warmstart=dataclasses.asdict(ws),
                tracking=dataclasses.asdict(tracking), benchmarks=benchmarks, data_dir=data_dir, bench_limit=bench_limit,
                bench_max_new_tokens=bench_max_new_tokens, system_metrics_interval_s=system_metrics_interval_s,
                launch=spec_to_dict(launch or LaunchSpec())))
            for cfg, run_dir in jobs])
    records = [train_and_evaluate(cfg, run_dir, ws, tracking, launch, benchmarks, data_dir, bench_limit,
                                  bench_max_new_tokens, system_metrics_interval_s) for cfg, run_dir in jobs]
    return records


def parent_params(cfg: TrainConfig, **flow_values: Any) -> dict[str, Any]:
    d = config_to_dict(cfg)
    d["rl"].pop("variant"), d["rl"].pop("seed")  # per child run
    return {**d, "flow": {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flow_values.items()}}


def launch_params(spec: LaunchSpec) -> tuple[dict[str, str], dict[str, Any]]:
    """(tags, params) recording a comparison's topology on its parent run (``launch.*``)."""
    topo = spec.topology()
    return topology_tags(topo), {"launch": topo}


@flow(name="compare-variants", log_prints=True)
def compare_variants(
    preset: str = "tiny",
    variants: list[str] = DEFAULT_VARIANTS,
    oppo: list[str] | None = None,
    seeds: list[int] = [0],
    steps: int | None = None,
    max_staleness: int | None = None,
    checkpoint_every: int | None = None,
    model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    variant_overrides: dict[str, dict[str, Any]] | None = None,
    benchmarks: list[str] = list(BENCHMARKS),
    bench_limit: int | None = 50,
    bench_max_new_tokens: int = 64,
    data_dir: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = "a3po-compare",
    output_dir: str | None = None,
    cache_dir: str | None = None,
    target_fraction: float = TARGET_FRACTION,
    smooth_frac: float = SMOOTH_FRAC,
    torch_threads: int | None = None,
    system_metrics_interval_s: float = 10.0,
    launch: str | dict[str, Any] = "local",
    fanout_deployment: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate ``variants`` x ``seeds`` from one warm start; compare them.

    preset: built-in config (tiny: learns in minutes on CPU; micro: seconds, plumbing only).
    variants: any of sync, recompute, loglinear. oppo: OPPO modes (off, intra, inter, both;
    tasks.arms) compared like the variants: each variant runs once per mode, as the arm
    ``<variant>`` (off) or ``<variant>+oppo-<mode>``; None (default): as the config says.
    A mode the config cannot run (intra on the GRPO path, both) fails here, naming the field.
    seeds: RL seeds (paired across variants and modes).
    steps / max_staleness / checkpoint_every: override ``rl.*``. model: built-in arch or HF path.
    dataset: folder with train.jsonl and heldout.jsonl ({id, prompt, gold[, solution]}).
    task: grading task of the dataset (arith, gsm8k, math500, aime24). config: YAML TrainConfig.
    overrides: ``{section: {field: value}}`` for every variant; variant_overrides:
    ``{variant: {rl_field: value}}`` (e.g. ``{"loglinear": {"proximal": "metrics"}}`` logs
    loglinear's approximation error). benchmarks / bench_limit / bench_max_new_tokens / data_dir:
    benchmark evaluation (skipped, and recorded, when data_dir lacks the files).
    tracking_uri: MLflow store (default $MLFLOW_TRACKING_URI or sqlite ./mlflow.db).
    output_dir: run dirs (default runs/compare-<preset>); re-running resumes; ``{date}`` in it
    becomes the UTC date (a scheduled comparison trains afresh each time). cache_dir: dataset
    and warm-start cache (default <output_dir>/cache). target_fraction / smooth_frac: see
    tasks.summary. torch_threads: overrides the config's ``torch_threads`` (intra-op threads of
    each of the trainer's two Python threads; the library's default 1 suits 2 cores).
    launch: "local" (in-process, the default) or a LaunchSpec as a dict, e.g. ``{"mode":
    "torchrun", "nproc_per_node": 2}``: each training then runs ``python -m a3po.cli train`` as
    launched ranks (infra.launch; docs/distributed.md); the topology is recorded on the runs.
    fanout_deployment: e.g. "train-one/train-one" (infra/prefect.yaml): each variant x seed runs
    as a run of that deployment on its pool's workers, in parallel (flows.train_one; needs a real
    Prefect server, an output dir every worker sees, and an MLflow store each can reach); the
    data and the warm start are prepared here once. None (default): in this process, in turn.
    """
    t0 = time.perf_counter()
    spec = launch_spec(launch)  # raises naming the field, before anything runs
    base = build_config(preset, config, model, dataset, task, steps, max_staleness, checkpoint_every, overrides, torch_threads)
    spec = launch_for_config(spec, base)  # the ZeRO stage the ranks will run, for the record
    # The arms by the name of the config each builds; an unknown name or unsupported combination raises here.
    arms = list(dict.fromkeys(arm_name(variant_config(base, a, seeds[0] if seeds else 0, variant_overrides)) for a in expand_arms(variants, oppo)))
    out = output_folder(preset, output_dir)
    cache = Path(cache_dir).resolve() if cache_dir else out / "cache"
    uri = tracking_uri or default_tracking_uri()
    data_dir = data_dir if data_dir is not None else default_data_dir()
    flow_values = dict(preset=preset, variants=variants, oppo=oppo, seeds=seeds, benchmarks=benchmarks, bench_limit=bench_limit,
                       data_dir=data_dir, target_fraction=target_fraction, smooth_frac=smooth_frac, variant_overrides=variant_overrides)
    with hold_run_folder(out, log=get_run_logger().warning):  # one writer per output folder, for the whole flow run
        launch_tags, launch_param = launch_params(spec)
        ref = open_parent_run(uri, experiment, f"compare-{preset}", str(out),
                              {"a3po.kind": "compare", "a3po.preset": preset, "a3po.variants": ",".join(arms), "a3po.seeds": ",".join(map(str, seeds)),
                               "a3po.fanout": fanout_deployment or "none", **launch_tags},
                              {**parent_params(base, **flow_values), **launch_param})
        try:
            records = run_comparison(base, ref, out, cache, arms, seeds, variant_overrides, benchmarks, data_dir,
                                     bench_limit, bench_max_new_tokens, system_metrics_interval_s, spec, fanout_deployment)
            links = tag_run_links(ref, [r["mlflow_run_id"] for r in records])
            summary = summarise(records, str(out / "summary"), target_fraction, smooth_frac)
            log_to_parent(ref, summary["metrics"], summary["artifacts"])
        except BaseException:
            close_parent_run(ref, "FAILED")
            raise
        close_parent_run(ref, "FINISHED")
        return {**result_of(ref, out, base, records, summary, time.perf_counter() - t0), "links": links}


def result_of(ref: TrackingRef, out: Path, base: TrainConfig, records: list[dict], summary: dict, wall_s: float) -> dict[str, Any]:
    return {
        "parent_run_id": ref.parent_run_id,
        "experiment_id": ref.experiment_id,
        "tracking_uri": ref.tracking_uri,
        "output_dir": str(out),
        "steps": base.rl.steps,
        "runs": records,
        "summary": summary,
        "wall_s": wall_s,
    }


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The flat JSON line printed last."""
    rows = result["summary"]["rows"]
    figs: dict[str, Any] = {
        "variants": [r["variant"] for r in rows],
        "seeds": rows[0]["seeds"] if rows else 0,
        "steps": result["steps"],
        "target_reward": result["summary"]["target"],
    }
    for r in rows:
        for k in ("final_acc", "final_reward", "mean_step_time_s", "time_to_target_s"):
            figs[f"{r['variant']}/{k}"] = None if r[k] is None else round(r[k], 4)
    figs.update({k: round(v, 4) for k, v in result["summary"]["metrics"].items() if k.startswith("speedup/")})
    figs.update({"parent_run_id": result["parent_run_id"], "parent_run_url": result["links"]["parent_run"],
                 "tracking_uri": result["tracking_uri"], "wall_s": round(result["wall_s"], 1)})
    return figs


# --- command line -------------------------------------------------------------------------


def parse_sets(items: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--set rl.lr=1e-3`` (all variants; ``--set torch_threads=2`` for a top-level field) /
    ``--set loglinear:rl.proximal=metrics`` (one variant, or one arm such as
    ``loglinear+oppo-inter:``; rl fields only). Values are parsed as
    YAML scalars."""
    overrides: dict[str, Any] = {}
    per_variant: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            _usage_error(f"--set expects [variant:]section.field=value, got {item!r}")
        variant, _, dotted = key.rpartition(":")
        section, _, field = dotted.partition(".")
        value = _scalar(raw)
        if not field:  # a top-level field, e.g. torch_threads=2
            if variant:
                _usage_error(f"--set {item!r}: per-variant overrides are rl fields only")
            overrides[section] = value
            continue
        if variant:
            if section != "rl":
                _usage_error(f"--set {item!r}: per-variant overrides are rl fields only")
            try:
                parse_arm(variant)  # a variant (all its arms) or one arm, e.g. loglinear+oppo-inter
            except ValueError as e:
                _usage_error(f"--set {item!r}: {e}")
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


def _usage_error(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as argparse does for a bad option."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _csv(s: str, cast=str) -> list:
    return [cast(x) for x in s.split(",") if x.strip()]


def build_parser(prog: str = "python -m flows.compare_variants") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="tiny (learns in minutes on CPU) or micro (seconds; nothing learns)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated subset of sync,recompute,loglinear")
    ap.add_argument("--oppo", default=None, metavar="MODES",
                    help=f"comma-separated OPPO modes ({','.join(OPPO_MODES.names())}) compared like the variants: one arm per "
                         "variant and mode, e.g. off,inter runs loglinear and loglinear+oppo-inter (default: as the config says)")
    ap.add_argument("--seeds", default="0", help="comma-separated RL seeds, e.g. 0,1,2")
    ap.add_argument("--steps", type=int, help="RL steps per run (rl.steps)")
    ap.add_argument("--max-staleness", type=int, help="rl.max_staleness (async variants)")
    ap.add_argument("--checkpoint-every", type=int, help="rl.checkpoint_every: atomic checkpoint period in steps")
    ap.add_argument("--model", help="built-in arch (micro, tiny, small) or a local HF model dir / hub name")
    ap.add_argument("--dataset", help="folder with train.jsonl and heldout.jsonl; default: the embedded task")
    ap.add_argument("--task", help="grading task of --dataset (arith, gsm8k, math500, aime24)")
    ap.add_argument("--config", help="YAML TrainConfig laid over the preset")
    ap.add_argument("--set", action="append", default=[], metavar="[VARIANT:]SECTION.FIELD=VALUE", help="config override (repeatable)")
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma-separated; '' for none")
    ap.add_argument("--bench-limit", type=int, default=50, help="first N problems of each benchmark (0: all)")
    ap.add_argument("--bench-max-new-tokens", type=int, default=64)
    ap.add_argument("--data-dir", default=None, help="benchmark files (<dir>/<name>/test.jsonl); default $A3PO_SHARED_DATA or ../shared/data; optional: benchmarks are skipped when absent")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store; default $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db")
    ap.add_argument("--experiment", default="a3po-compare")
    ap.add_argument("--output-dir", default=None, help="default runs/compare-<preset>; re-running with the same dir resumes")
    ap.add_argument("--cache-dir", default=None, help="dataset / warm-start cache; default <output-dir>/cache")
    ap.add_argument("--target-fraction", type=float, default=TARGET_FRACTION)
    ap.add_argument("--torch-threads", type=int, default=None, help="config torch_threads (default: the config's, 1)")
    ap.add_argument("--device", choices=[d.value for d in Device], default=None, help="config device (default: the config's, auto); same as --set device=...")
    ap.add_argument("--dtype", choices=[d.value for d in DType], default=None, help="config dtype (default: the config's, float32)")
    ap.add_argument("--system-metrics-interval", type=float, default=10.0, help="seconds between MLflow system-metric samples")
    add_launch_args(ap)
    ap.add_argument("--fanout-deployment", default=None, metavar="FLOW/DEPLOYMENT",
                    help="e.g. train-one/train-one: run each variant x seed as a run of this deployment on its work pool's "
                         "workers, in parallel (needs PREFECT_API_URL; docs/distributed.md); default: in this process")
    return ap


def add_launch_args(ap: argparse.ArgumentParser) -> None:
    """``--launch`` and the LaunchSpec fields (infra.launch; docs/distributed.md), shared by the flows."""
    g = ap.add_argument_group("launch (multi-process training; docs/distributed.md)")
    g.add_argument("--launch", choices=[m.value for m in LaunchMode], default="local",
                   help="local: in-process (default); torchrun / deepspeed: each training runs `python -m a3po.cli train` as launched ranks")
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
    g.add_argument("--zero-stage", type=int, help="ZeRO stage of the DeepSpeed config the ranks use (default: read from distributed.deepspeed_config; a different value is an error)")


def launch_from_args(args: argparse.Namespace) -> str | dict[str, Any]:
    """The flows' ``launch`` parameter from the flags: the mode name, or a dict of the fields given."""
    fields = {"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes, "node_rank": args.node_rank,
              "nodes": _csv(args.launch_nodes, int) if args.launch_nodes else None, "master_addr": args.master_addr,
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


def kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    overrides, per_variant = parse_sets(args.set)
    overrides.update({k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None})
    return dict(
        preset=args.preset, variants=_csv(args.variants), oppo=_csv(args.oppo) if args.oppo is not None else None, seeds=_csv(args.seeds, int), steps=args.steps,
        max_staleness=args.max_staleness, checkpoint_every=args.checkpoint_every, model=args.model, dataset=args.dataset,
        task=args.task, config=args.config, overrides=overrides or None, variant_overrides=per_variant or None,
        benchmarks=_csv(args.benchmarks), bench_limit=args.bench_limit or None, bench_max_new_tokens=args.bench_max_new_tokens,
        data_dir=args.data_dir, tracking_uri=args.tracking_uri or default_tracking_uri(), experiment=args.experiment,
        output_dir=args.output_dir, cache_dir=args.cache_dir, target_fraction=args.target_fraction,
        torch_threads=args.torch_threads, system_metrics_interval_s=args.system_metrics_interval,
        launch=launch_from_args(args), fanout_deployment=args.fanout_deployment,
    )


def check_configs(kwargs: dict[str, Any]) -> None:
    """Build the config of every variant now, so a bad value (file, --set, option) fails in one
    line before any server starts (the flow builds them again, as its parameters say)."""
    keys = ("preset", "config", "model", "dataset", "task", "steps", "max_staleness", "checkpoint_every", "overrides", "torch_threads")
    base = build_config(**{k: kwargs[k] for k in keys})
    for arm in expand_arms(kwargs["variants"], kwargs["oppo"]):
        cfg = variant_config(base, arm, kwargs["seeds"][0] if kwargs["seeds"] else 0, kwargs["variant_overrides"])
        if not kwargs["fanout_deployment"]:  # deployed workers check their own machine (train_variant)
            preflight(cfg)
    launch_for_config(launch_spec(kwargs["launch"]), base)  # e.g. 2 ranks without a DeepSpeed config


def main(argv: list[str] | None = None, prog: str = "python -m flows.compare_variants") -> int:
    args = build_parser(prog).parse_args(argv)
    kwargs = kwargs_from_args(args)
    try:
        check_configs(kwargs)
    except ValueError as e:  # ConfigError, or a launch that does not fit the config
        print(f"error: {e}", file=sys.stderr)
        return 2
    if kwargs["fanout_deployment"] and not os.environ.get("PREFECT_API_URL"):
        print("error: --fanout-deployment needs a Prefect server with workers: set PREFECT_API_URL (infra/start_prefect_server.sh)", file=sys.stderr)
        return 2
    try:  # refused here, before the Prefect server starts, when another run writes the folder
        with hold_run_folder(output_folder(args.preset, args.output_dir)), prefect_api() as api:
            result = compare_variants(**kwargs)
    except RunFolderBusy as e:
        print(f"compare_variants: {e}", file=sys.stderr)
        return 1
    print("\n" + result["summary"]["table_md"])
    for note in result["summary"]["notes"]:
        print(f"note: {note}")
    print(f"\nartifacts: {result['output_dir']}/summary   run dirs: {result['output_dir']}")
    print(f"MLflow parent run {result['parent_run_id']} in {result['tracking_uri']}")
    print("\n".join(RunLinks(**result["links"]).lines()))
    figs = key_figures(result)
    figs["prefect_server_startup_s"] = round(api["startup_s"], 1)
    print(json.dumps(figs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
