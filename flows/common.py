"""The skeleton the comparison flows share (compare_variants, nightly_parity, paper_claims).

Each flow takes one typed parameter, its spec: a :class:`ComparisonSpec` extended with the flow's
own fields (checked when built, naming the field; Prefect renders it as the deployment's run form
and validates it before the flow starts). Each flow is: its spec -> the base config -> the output
folder held for the whole flow run -> the MLflow parent run (:func:`parent_run`, closed FAILED
or FINISHED) -> :func:`run_comparison` (train and evaluate every arm x seed) -> links and
summary (:func:`compare_and_summarise`) -> the flow's own judgement -> the parent run's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Iterator

from prefect import get_run_logger
from pydantic import BaseModel, ConfigDict, Field, field_validator

from a3po.config import ConfigError, TrainConfig, config_to_dict, merge_yaml, with_overrides
from a3po.config import preset as load_preset
from a3po.config.loading import file_fields, replaced_file_values
from a3po.redact import mask_uri
from a3po.storage.runlock import hold_run_folder
from flows.train_one import fan_out, spec_to_dict, train_and_evaluate
from infra.launch import LaunchSpec, launch_spec
from tasks.arms import Arm
from tasks.artifacts import flow_key, publish_failure, publish_flow_artifacts
from tasks.child_run import topology_tags
from tasks.data import dataset_ready, prepare_dataset, with_prepared_data
from tasks.description import describe_parent_run
from tasks.evaluation import evaluate_checkpoint
from tasks.links import tag_run_links, ui_address
from tasks.pairs import Setting, summarise_pairs
from tasks.pictures import log_run_pictures
from tasks.runtime import default_tracking_uri
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION, summarise
from tasks.tracking import TrackingRef, close_parent_run, close_parent_run_quietly, open_parent_run, probe_tracking
from tasks.training import WarmStart, run_dir_for, warm_start, warmstart_ready


def default_data_dir() -> str:
    """Benchmark files: ``$A3PO_SHARED_DATA`` or ``../shared/data``; absent is fine (skipped)."""
    return os.environ.get("A3PO_SHARED_DATA") or str(Path.cwd().parent / "shared" / "data")


class ComparisonSpec(BaseModel):
    """What every comparison flow is given besides its own judgement: the config, the seeds, the
    benchmarks, where results and tracking go, and how training is launched. Each flow's spec
    extends it with the flow's own fields and defaults. Unknown or ill-typed fields raise when the
    spec is built, naming the field."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)
    default_output_dir: ClassVar[str] = "runs/compare-{preset}"  # '{preset}' and '{date}' (UTC) are filled in

    preset: str = "tiny"
    """Built-in config: tiny (learns in minutes on CPU), micro (seconds, plumbing only), ... (a3po.config.PRESETS)."""
    config: str | None = None
    """YAML TrainConfig laid over the preset."""
    model: str | None = None
    """model.name: a built-in architecture or a Hugging Face model folder / hub name."""
    dataset: str | None = None
    """A folder with train.jsonl and heldout.jsonl (default: the preset's task)."""
    task: str | None = None
    """data.task: the grading task of the dataset (arith, gsm8k, math500, aime24)."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """RL seeds, paired across arms (each arm runs once per seed)."""
    steps: int | None = Field(default=None, ge=1)
    """rl.steps: RL steps per run (default: the config's)."""
    max_staleness: int | None = Field(default=None, ge=0)
    """rl.max_staleness: the staleness bound of the asynchronous variants."""
    checkpoint_every: int | None = Field(default=None, ge=1)
    """rl.checkpoint_every: atomic checkpoint period in steps."""
    overrides: dict[str, Any] | None = None
    """Config overrides for every arm: {section: {field: value}}."""
    variant_overrides: dict[str, dict[str, Any]] | None = None
    """Per-arm rl overrides: {variant or arm name: {rl_field: value}}."""
    torch_threads: int | None = Field(default=None, ge=1)
    """The config's torch_threads (default: the config's)."""
    benchmarks: list[str] = Field(default_factory=list)
    """Benchmarks evaluated on the step-0 and each final checkpoint (gsm8k, math500, aime24)."""
    bench_limit: int | None = Field(default=50, ge=1)
    """First N problems of each benchmark (None: all)."""
    bench_max_new_tokens: int = Field(default=64, ge=1)
    """Generation budget per benchmark problem."""
    data_dir: str | None = None
    """Benchmark files, <dir>/<name>/test.jsonl (default $A3PO_SHARED_DATA or ../shared/data; absent: skipped)."""
    tracking_uri: str | None = None
    """MLflow store (default $MLFLOW_TRACKING_URI or sqlite ./mlflow.db)."""
    experiment: str = "a3po-compare"
    """MLflow experiment of the parent and child runs."""
    output_dir: str | None = None
    """Run folders and summary; re-running resumes. '{preset}' and '{date}' (UTC) are filled in."""
    cache_dir: str | None = None
    """Dataset and warm-start cache (default: the output dir's cache/ folder)."""
    target_fraction: float = Field(default=TARGET_FRACTION, gt=0, le=1)
    """Reward target: first-step reward + this fraction of the best arm's gain (tasks.summary)."""
    smooth_frac: float = Field(default=SMOOTH_FRAC, gt=0, le=1)
    """Fraction of the steps the final reward is averaged over (tasks.summary)."""
    system_metrics_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between MLflow system-metric samples."""
    launch: str | dict[str, Any] = "local"
    """How training starts: 'local' (in-process) or LaunchSpec fields, e.g. {mode: torchrun, nproc_per_node: 2} (infra.launch)."""

    @field_validator("launch")
    @classmethod
    def _launch_is_a_spec(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        launch_spec(value)  # raises naming the LaunchSpec field
        return value

    @field_validator("seeds")
    @classmethod
    def _seeds_once(cls, value: list[int]) -> list[int]:
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:  # one run per arm and seed: a repeat would be counted as a seed it is not
            raise ValueError(f"seeds repeat {repeated}: each seed is one paired run per arm; give each once")
        return value

    @field_validator("variant_overrides")
    @classmethod
    def _keys_are_arms(cls, value: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
        for name in value or {}:
            Arm.parse(name)  # a variant (all its arms) or one arm, e.g. loglinear+oppo-inter
        return value

    def train_config(self) -> TrainConfig:
        base = build_config(self.preset, self.config, self.model, self.dataset, self.task, self.steps, self.max_staleness,
                            self.checkpoint_every, self.overrides, self.torch_threads)
        if self.config and "rl.seed" in file_fields(self.config) and [base.rl.seed] != list(self.seeds):
            # Every run takes its seed from the comparison's seeds: the file's is replaced, said aloud.
            warn_once(f"rl.seed: {base.rl.seed} from {self.config} is replaced by the comparison's seeds {list(self.seeds)} (--seeds)")
        return base

    def output_folder(self) -> Path:
        """'{date}' gives each scheduled run its own folder (a re-run the same day resumes)."""
        template = self.output_dir or self.default_output_dir
        return Path(template.replace("{preset}", self.preset).replace("{date}", f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}")).resolve()

    def cache_folder(self, out: Path) -> Path:
        return Path(self.cache_dir).resolve() if self.cache_dir else out / "cache"

    def store(self) -> str:
        return self.tracking_uri or default_tracking_uri()

    def launch_spec(self) -> LaunchSpec:
        return launch_spec(self.launch)


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
    combinations raise here, before anything runs). A field set twice is never silently
    replaced: by ``overrides`` and by its own parameter (``--set rl.steps=3 --steps 5``) it is
    refused, as no order between them is natural; by the YAML and an explicit value, the explicit
    one wins with a warning naming both."""
    cfg = load_preset(preset)
    if config:
        cfg = merge_yaml(cfg, config)
    sections: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (overrides or {}).items()}

    def give(dotted: str, value: Any, option: str) -> None:
        *path, field = dotted.split(".")
        d = sections
        for part in path:
            d = d.setdefault(part, {})
        if field in d and d[field] != value:
            raise ConfigError(f"{dotted} is given twice, {d[field]!r} in overrides (--set) and {value!r} as {option}: give it once")
        d[field] = value

    if model:
        give("model.name", model, "model (--model)")
    if dataset:
        give("data.train_path", str(Path(dataset) / "train.jsonl"), "dataset (--dataset)")
        give("data.heldout_path", str(Path(dataset) / "heldout.jsonl"), "dataset (--dataset)")
    if task:
        give("data.task", task, "task (--task)")
    for key, val in (("steps", steps), ("max_staleness", max_staleness), ("checkpoint_every", checkpoint_every)):
        if val is not None:
            give(f"rl.{key}", val, f"{key} (--{key.replace('_', '-')})")
    if torch_threads:
        give("torch_threads", torch_threads, "torch_threads (--torch-threads)")
    final = with_overrides(cfg, **sections)
    for line in replaced_file_values(config, cfg, final) if config else []:
        warn_once(line)
    return final


_WARNED: set[str] = set()


def warn_once(line: str) -> None:
    """``line`` on stderr as a warning, once per process (the base config is built by every check
    and again by the flow)."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(f"warning: {line}", file=sys.stderr)


def variant_config(base: TrainConfig, arm: Arm, seed: int, variant_overrides: dict[str, dict[str, Any]] | None) -> TrainConfig:
    """The config of one arm (tasks.arms) and seed; ``variant_overrides`` keyed by the variant
    apply to all its arms, keyed by an arm's name to that one."""
    vo = variant_overrides or {}
    # Keys read as names are (``loglinear+s2`` is written ``loglinear``: the default bound is left out).
    by_name = {Arm.parse(k).name: v for k, v in vo.items() if k != arm.variant.value}
    own = by_name.get(arm.name, {})
    return arm.config(base, seed, {**vo.get(arm.variant.value, {}), **own})


def parent_params(cfg: TrainConfig, **flow_values: Any) -> dict[str, Any]:
    """The parent run's params: the base config (less the per-child variant and seed) and the
    flow's own values under ``flow.*``."""
    d = config_to_dict(cfg)
    d["rl"].pop("variant"), d["rl"].pop("seed")  # per child run
    return {**d, "flow": {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flow_values.items()}}


def launch_params(spec: LaunchSpec) -> tuple[dict[str, str], dict[str, Any]]:
    """(tags, params) recording a comparison's topology on its parent run (``launch.*``)."""
    topo = spec.topology()
    return topology_tags(topo), {"launch": topo}


@contextlib.contextmanager
def parent_run(spec: ComparisonSpec, out: Path, run_name: str, tags: dict[str, str], params: dict[str, Any]) -> Iterator[TrackingRef]:
    """Hold ``out`` (one writer per output folder) and the flow's MLflow parent run for the body.

    The tracking store is probed first (bounded: a store that is down fails here in seconds,
    naming it, before any training). The run ends FINISHED when the body returns, FAILED when it
    raises (SIGTERM, Ctrl-C included), and then the flow run's verdict artifact says FAIL and why
    (tasks.artifacts); closing FAILED is bounded too and never hides the error."""
    uri = spec.store()
    probe_tracking(uri)
    with hold_run_folder(out, log=get_run_logger().warning):
        ref = open_parent_run(uri, spec.experiment, run_name, str(out), tags, params)
        try:
            yield ref
        except BaseException as e:
            close_parent_run_quietly(ref, "FAILED")
            publish_failure(flow_key(run_name, spec.experiment), run_name, e, ref.parent_run_id)
            raise
        close_parent_run(ref, "FINISHED")


def publish_artifacts(spec: ComparisonSpec, run_name: str, ref: TrackingRef, summary: dict[str, Any], records: list[dict[str, Any]],
                      links: dict[str, Any], verdict_md: str | None = None) -> dict[str, Any]:
    """The flow run's Prefect artifacts (tasks.artifacts), keyed by its run name and experiment;
    a flow without a verdict of its own is titled by its arms and seeds."""
    seeds = sorted({r["seed"] for r in records})
    title = f"{run_name}: {len(summary['rows'])} arms x seeds {', '.join(map(str, seeds))}"
    return publish_flow_artifacts(flow_key(run_name, spec.experiment), summary, records, ui_address(ref.tracking_uri), ref.experiment_id,
                                  links, verdict_md, title)


def run_comparison(
    spec: ComparisonSpec,
    base: TrainConfig,
    tracking: TrackingRef,
    output_dir: Path,
    arms: list[Arm],
    launch: LaunchSpec | None = None,
    fanout_deployment: str | None = None,
) -> list[dict[str, Any]]:
    """One record per arm x seed (``spec.seeds``), trained and evaluated from one warm start.
    ``launch`` (not local): each training runs as ranks of ``python -m a3po.training.command``
    (tasks.launched.train_launched). ``fanout_deployment``: each arm x seed runs as a run of that
    ``train-one`` deployment, all submitted at once, on the workers of its pool
    (flows.train_one); else here, in turn. ``arms``: tasks.arms.Arm; each record's ``arm`` is
    the name of the config that ran (:attr:`tasks.arms.Arm.name`)."""
    cache_dir = spec.cache_folder(output_dir)
    data_dir = spec.data_dir if spec.data_dir is not None else default_data_dir()
    # Cached by input hashes; a cache folder deleted by hand refreshes the record instead.
    data = prepare_dataset.with_options(refresh_cache=not dataset_ready(base, cache_dir))(base, str(cache_dir))
    base = with_prepared_data(base, data)
    ws = warm_start.with_options(refresh_cache=not warmstart_ready(base, cache_dir))(base, str(cache_dir))
    get_run_logger().info(f"dataset {data.key}: {data.n_train} train / {data.n_heldout} held-out rows; warm-start held-out acc {ws.heldout_acc:.3f}")
    # Seed-major: one seed's arms run back to back, so a slow spell of the host falls on every arm alike.
    jobs = [(cfg, str(run_dir_for(output_dir, cfg))) for cfg in
            (variant_config(base, arm, seed, spec.variant_overrides) for seed in spec.seeds for arm in arms)]
    evaluation = dict(benchmarks=spec.benchmarks, data_dir=data_dir, bench_limit=spec.bench_limit,
                      bench_max_new_tokens=spec.bench_max_new_tokens, system_metrics_interval_s=spec.system_metrics_interval_s)
    step0 = step0_benchmarks(ws, base, spec, data_dir, cache_dir)
    if fanout_deployment:
        return [{**r, "step0_eval": step0} for r in fan_out(fanout_deployment, [
            (f"{Arm.of(cfg).name} seed {cfg.rl.seed}", run_dir,
             # The store's secrets stay out of Prefect's flow-run parameters: each worker reads its own (flows.train_one).
             dict(config=config_to_dict(cfg), run_dir=run_dir, warmstart=dataclasses.asdict(ws),
                  tracking={**dataclasses.asdict(tracking), "tracking_uri": mask_uri(tracking.tracking_uri)},
                  launch=spec_to_dict(launch or LaunchSpec()), **evaluation))
            for cfg, run_dir in jobs])]
    return [{**train_and_evaluate(cfg, run_dir, ws, tracking, launch, **evaluation), "step0_eval": step0} for cfg, run_dir in jobs]


def step0_benchmarks(ws: WarmStart, base: TrainConfig, spec: ComparisonSpec, data_dir: str, cache_dir: Path) -> dict[str, float]:
    """The step-0 model (the warm start every arm starts from) on the comparison's benchmarks,
    as ``eval/step0/<bench>/<metric>``, beside the final models' ``eval/final/...``; {} without benchmarks."""
    if not spec.benchmarks:
        return {}
    ev = evaluate_checkpoint(ws.dir, base, spec.benchmarks, data_dir, spec.bench_limit, spec.bench_max_new_tokens, str(cache_dir / "eval-step0"))
    return {k.replace("eval/final/", "eval/step0/", 1): v for k, v in ev["metrics"].items() if k.startswith("eval/final/")}


# Spec fields that change what the preset runs: a recorded calibration (tasks.parity.CALIBRATIONS) no longer holds.
CALIBRATION_BREAKERS = ("config", "overrides", "model", "dataset", "task")


def calibration_setting(spec: ComparisonSpec, base: TrainConfig) -> Setting:
    """What the pairs' reward verdicts rest on: a calibration holds only where it was measured, the
    preset as shipped at these steps (tasks.pairs.calibration_of)."""
    return Setting(spec.preset, base.rl.steps, spec.smooth_frac, tuple(k for k in CALIBRATION_BREAKERS if getattr(spec, k)))


def compare_and_summarise(spec: ComparisonSpec, base: TrainConfig, ref: TrackingRef, out: Path, arms: list[Arm], launch: LaunchSpec | None = None,
                          fanout_deployment: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``(records, links, summary)``: the comparison, its links tagged on the parent run, its
    summary (table, speedups, plots, and the pairs with their intervals: tasks.pairs) written under
    ``<out>/summary`` and set as the parent run's Description (a flow with a verdict sets it again,
    verdict first), and each child run's pictures."""
    records = run_comparison(spec, base, ref, out, arms, launch=launch, fanout_deployment=fanout_deployment)
    links = tag_run_links(ref, [r["mlflow_run_id"] for r in records])
    summary = summarise(records, str(out / "summary"), spec.target_fraction, spec.smooth_frac)
    summary = summarise_pairs(summary, records, calibration_setting(spec, base), str(out / "summary"))
    log_run_pictures(ref, records)
    describe_parent_run(ref, summary, records, links)
    return records, links, summary
