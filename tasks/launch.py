"""``launch_ranks``: run a command as torchrun / DeepSpeed ranks from a flow (thin over :mod:`infra.launch`).

Every output line of every rank goes into the flow run's logs as ``[rank N] text`` (launcher
lines as ``[launcher] text``) while it runs; the task returns a :class:`LaunchRecord` (topology,
exit codes, wall time) and fails, with the failing rank, its exit code or signal and its last
lines in the message, when a rank dies; the other ranks are stopped, none is left running.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.launch import LaunchSpec, launch
from tasks.runtime import run_logger


@dataclass(frozen=True)
class LaunchRecord:
    topology: dict[str, Any]  # mode, nodes, ranks_per_node, world_size, devices, zero_stage
    exit_codes: dict[int, int]  # per node launcher
    wall_s: float
    lines: dict[str, int]  # output lines seen per rank
    commands: dict[int, list[str]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@task(cache_policy=NO_CACHE, task_run_name="launch-{spec.mode.value}")
def launch_ranks(spec: LaunchSpec, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 rank_log_dir: str | None = None) -> LaunchRecord:
    """Run ``python <argv>`` (``["-m", "a3po.training.command", ...]``) as the ranks of ``spec``."""
    log = run_logger()

    def on_line(rank: int | None, text: str) -> None:
        log.info(f"[launcher] {text}" if rank is None else f"[rank {rank}] {text}")

    topo = spec.topology()
    log.info(f"launching {' '.join(argv)} with {spec.mode.value}: {topo}")
    res = launch(spec, argv, on_line=on_line, env=env, cwd=cwd, rank_log_dir=rank_log_dir)
    log.info(f"all ranks finished in {res.wall_s:.1f} s (launcher exit codes {res.exit_codes})")
    return LaunchRecord(res.topology, res.exit_codes, res.wall_s, res.lines, res.commands)
