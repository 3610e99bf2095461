"""Launching ranks (infra.launch, tasks.launch): real torchrun processes running a real
torch.distributed program (``tests.support.launch_probe``: gloo all-reduce of the ranks, a checkpointed
counter, a crash on request), through the Prefect task inside real flows.

1. A 2-process torchrun launch through ``launch_ranks`` in a flow: every rank's lines reach the
   flow run's logs (read back from the Prefect API), the record carries the topology.
2. A rank SIGKILLed mid-run fails the task with a message naming the rank and the signal; no
   process started by the launch is left (psutil).
3. The torchrun launcher itself SIGKILLed: its orphaned workers are stopped too.
4. Two "nodes" (node ranks 0 and 1, two torchrun processes on 127.0.0.1) form one world of 2.
5. LaunchSpec validation errors name the field; the launcher command lines carry the options.
"""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path

import psutil
import pytest

from infra.launch import LaunchMode, LaunchSpec, RankFailure, launch, launch_spec, launcher_commands, read_hostfile
from tests.support.cli_runs import descendants, flow_logs, without_timing

PROBE = ["-m", "tests.support.launch_probe"]


def _probe_pids(lines: list[str]) -> set[int]:
    return {int(m.group(1)) for ln in lines for m in [re.search(r"probe rank \d+/\d+ pid (\d+)", ln)] if m}


def _running(pid: int) -> bool:
    """``pid`` is alive and still a probe (not a reused pid)."""
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "tests.support.launch_probe" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def test_two_ranks_through_the_prefect_task_stream_into_flow_logs(prefect_server, tmp_path):
    from prefect import flow
    from prefect.runtime import flow_run

    from tasks.launch import launch_ranks

    ckpt = tmp_path / "counter"

    @flow(name="launch-probe")
    def probe_flow() -> tuple[str, dict]:
        rec = launch_ranks(LaunchSpec(mode="torchrun", nproc_per_node=2), [*PROBE, "--steps", "3", "--ckpt", str(ckpt)])
        return flow_run.id, rec.as_dict()

    run_id, rec = probe_flow()
    assert rec["topology"] == {"mode": "torchrun", "nodes": 1, "ranks_per_node": 2, "world_size": 2, "devices": "cpu", "zero_stage": None}
    assert rec["exit_codes"] == {0: 0}
    logs = flow_logs(run_id)
    for rank in (0, 1):
        for step in (1, 2, 3):
            # all-reduce of the ranks 0 + 1 = 1, on each rank; stdout and stderr both arrive
            assert f"[rank {rank}] probe rank {rank} step {step} allreduce 1" in logs
            assert f"[rank {rank}] probe rank {rank} step {step} stderr" in logs
        assert f'[rank {rank}] {{"rank": {rank}, "world_size": 2, "steps": 3, "resumed_from": 0}}' in logs
    assert ckpt.read_text() == "3"  # rank 0's checkpointed counter


def test_sigkilled_rank_fails_the_task_naming_it_and_leaves_nothing_running(prefect_server, tmp_path):
    from prefect import flow

    from tasks.launch import launch_ranks

    before = descendants()

    @flow(name="launch-probe-crash")
    def crash_flow() -> None:
        # rank 1 SIGKILLs itself at step 2 while rank 0 waits in the all-reduce of step 2
        launch_ranks(LaunchSpec(mode="torchrun", nproc_per_node=2, grace_s=5),
                     [*PROBE, "--steps", "50", "--sleep", "0.2", "--crash-rank", "1", "--crash-at", "2", "--crash-signal", "KILL"])

    state = crash_flow(return_state=True)
    assert state.is_failed()
    err = state.result(raise_on_failure=False)
    assert isinstance(err, RankFailure), repr(err)
    msg = str(err)
    assert msg.startswith("rank 1 (node 0, local rank 1) failed with exit signal 9 (SIGKILL)"), msg
    assert "probe rank 1 crashing at step 2 with KILL" in msg  # its last output lines
    assert err.rank == 1 and err.exitcode == -9
    left = descendants() - before
    assert not left, [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
    pids = _probe_pids(flow_logs(state.state_details.flow_run_id))
    assert len(pids) == 2 and not any(_running(p) for p in pids)


@pytest.mark.slow
def test_killed_launcher_takes_its_orphaned_ranks_with_it():
    """torchrun starts its workers in new sessions: when torchrun itself is SIGKILLed, only the
    launcher's record of descendants can stop them."""
    before = descendants()
    lines: list[str] = []
    killed = threading.Event()

    def on_line(rank, text):
        lines.append(text)
        if rank == 0 and "step 2 allreduce" in text and not killed.is_set():
            killed.set()
            (torchrun,) = [p for p in psutil.Process().children() if "torch.distributed.run" in " ".join(p.cmdline())]
            torchrun.send_signal(signal.SIGKILL)

    with pytest.raises(RankFailure) as exc:
        launch(LaunchSpec(mode="torchrun", nproc_per_node=2, grace_s=5), [*PROBE, "--steps", "200", "--sleep", "0.1"], on_line=on_line)
    assert killed.is_set()
    assert str(exc.value).startswith("the launcher of node 0 failed with exit signal 9 (SIGKILL)"), str(exc.value)
    pids = _probe_pids(lines)
    assert len(pids) == 2 and not any(_running(p) for p in pids)  # the orphans were stopped
    assert not (descendants() - before)


def test_two_loopback_nodes_form_one_world(tmp_path):
    got: dict[int, list[str]] = {0: [], 1: []}
    spec = LaunchSpec(mode="torchrun", nnodes=2, nproc_per_node=1, nodes=(0, 1), master_addr="127.0.0.1")
    res = launch(spec, [*PROBE, "--steps", "2"], on_line=lambda r, t: got[r].append(t) if r is not None else None)
    assert res.exit_codes == {0: 0, 1: 0}  # one torchrun per node rank
    assert res.topology["nodes"] == 2 and res.topology["world_size"] == 2
    assert [c[c.index("--node-rank") + 1] for c in res.commands.values()] == ["0", "1"]
    for rank in (0, 1):  # global rank = node rank x 1 + local rank 0
        assert any(t.startswith(f"probe rank {rank}/2 ") and "local_rank 0" in t for t in got[rank]), got[rank]
        assert f"probe rank {rank} step 2 allreduce 1" in got[rank]


@pytest.mark.parametrize("fields, field", [
    ({"mode": "mpirun"}, "launch.mode"),
    ({"mode": "torchrun", "nproc_per_node": 0}, "launch.nproc_per_node"),
    ({"mode": "torchrun", "nnodes": 2, "node_rank": 2, "master_port": 29500}, "launch.node_rank"),
    ({"mode": "torchrun", "nnodes": 2, "nodes": (0, 2)}, "launch.nodes"),
    ({"mode": "torchrun", "nnodes": 2, "node_rank": 1}, "launch.master_port"),  # the other node needs to know it
    ({"mode": "torchrun", "master_port": 70000}, "launch.master_port"),
    ({"mode": "torchrun", "hostfile": "hosts"}, "launch.hostfile"),
    ({"mode": "local", "nproc_per_node": 2}, "launch.nproc_per_node"),
    ({"mode": "deepspeed", "nproc_per_node": 2}, "launch.nproc_per_node"),
    ({"mode": "deepspeed", "include": "localhost:0", "num_gpus": 1}, "launch.include"),
    ({"mode": "deepspeed", "num_nodes": 2}, "launch.num_nodes"),
    ({"mode": "deepspeed", "hostfile": "/nonexistent/hostfile"}, "launch.hostfile"),
    ({"mode": "torchrun", "zero_stage": 4}, "launch.zero_stage"),
    ({"mode": "torchrun", "devices": "tpu"}, "launch.devices"),
    ({"mode": "torchrun", "nproc_per_node": "2"}, "launch.nproc_per_node"),
])
def test_spec_validation_names_the_field(fields, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        LaunchSpec(**fields)


def test_launch_parameter_and_hostfile_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gpus'\]"):
        launch_spec({"mode": "torchrun", "gpus": 2})
    assert launch_spec("torchrun").mode is LaunchMode.TORCHRUN and launch_spec(None).mode is LaunchMode.LOCAL
    bad = tmp_path / "hostfile"
    bad.write_text("# nodes\nnode-0 slots=2\nnode-1 slot=2\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:3: expected '<host> slots=<N >= 1>'")):
        read_hostfile(bad)


def test_launcher_command_lines(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu-node-0 slots=8\ngpu-node-1 slots=8  # second\n")
    ds = LaunchSpec(mode="deepspeed", hostfile=str(hostfile), num_nodes=2, num_gpus=4, master_addr="gpu-node-0", zero_stage=2, devices="cuda")
    (cmd,) = launcher_commands(ds, ["-m", "a3po.training.command", "--preset", "tiny"], 29500).values()
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[3:] == ["--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "4", "--master_addr", "gpu-node-0",
                       "--master_port", "29500", "--no_local_rank", "--module", "a3po.training.command", "--preset", "tiny"]
    assert ds.topology() == {"mode": "deepspeed", "nodes": 2, "ranks_per_node": 4, "world_size": 8, "devices": "cuda", "zero_stage": 2}
    assert LaunchSpec(mode="deepspeed", hostfile=str(hostfile)).topology()["world_size"] == 16  # 2 hosts x 8 slots
    tr = LaunchSpec(mode="torchrun", nnodes=2, node_rank=1, nproc_per_node=8, master_addr="10.0.0.1", master_port=29400)
    (node, cmd), = launcher_commands(tr, ["train.py", "--x"], 29400).items()
    assert node == 1 and cmd[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1",
                                     "--master-addr", "10.0.0.1", "--master-port", "29400", "--tee", "3", "--max-restarts", "0", "train.py", "--x"]


@pytest.mark.slow
def test_launched_training_equals_in_process_training_and_records_topology(prefect_server, tmp_path):
    """The flow's torchrun path (one rank: today's trainer is single-process) runs
    ``python -m a3po.training.command`` on the run's config YAML and reads its results back: the same
    per-step history and final accuracy as the in-process path (deterministic schedule), and
    the topology on the parent and child MLflow runs."""
    import mlflow

    from flows.compare_variants import CompareSpec, compare_variants

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = dict(preset="micro", variants=["loglinear"], seeds=[0], steps=4, tracking_uri=uri, experiment="launch",
                  cache_dir=str(tmp_path / "cache"), benchmarks=[])
    local = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "local")))
    launched = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "launched"), launch={"mode": "torchrun", "nproc_per_node": 1}))
    (l_run,), (t_run,) = local["runs"], launched["runs"]
    assert Path(t_run["final_dir"]).parent.parent == Path(t_run["run_dir"])  # the CLI wrote into the run dir
    assert (Path(t_run["run_dir"]) / "config.yaml").exists()
    assert t_run["final_acc"] == l_run["final_acc"] and t_run["warmstart_acc"] == l_run["warmstart_acc"]
    assert without_timing(t_run["history_path"]) == without_timing(l_run["history_path"])
    assert len(without_timing(t_run["history_path"])) == 4

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["launch"])
    child = runs[runs["run_id"] == t_run["mlflow_run_id"]].iloc[0]
    parent = runs[runs["run_id"] == launched["parent_run_id"]].iloc[0]
    for row in (child, parent):
        assert row["params.launch.mode"] == "torchrun" and row["tags.a3po.launch.mode"] == "torchrun"
        assert (row["params.launch.nodes"], row["params.launch.ranks_per_node"], row["params.launch.world_size"]) == ("1", "1", "1")
        assert row["params.launch.devices"] == "cpu" and row["params.launch.zero_stage"] == "None"  # no DeepSpeed config
    assert child["status"] == "FINISHED" and child["metrics.final/heldout_acc"] == l_run["final_acc"]
    local_parent = runs[runs["run_id"] == local["parent_run_id"]].iloc[0]
    assert local_parent["params.launch.mode"] == "local"


@pytest.mark.slow
def test_deepspeed_launcher_streams_per_rank_logs_and_stops_all_on_a_dead_rank():
    """The real DeepSpeed launcher (CPU accelerator, 2 local ranks): lines per rank from its
    per-rank log files; a SIGKILLed rank: the run fails naming it, the others are stopped,
    nothing is left."""
    before = descendants()
    got: dict = {0: [], 1: [], None: []}
    spec = LaunchSpec(mode="deepspeed", num_gpus=2, grace_s=5)
    res = launch(spec, [*PROBE, "--steps", "2"], on_line=lambda r, t: got[r].append(t))
    assert res.topology["world_size"] == 2 and res.exit_codes == {0: 0}
    for rank in (0, 1):
        assert f"probe rank {rank} step 2 allreduce 1" in got[rank]
    lines: list[str] = []
    with pytest.raises(RankFailure) as exc:
        launch(spec, [*PROBE, "--steps", "50", "--sleep", "0.2", "--crash-rank", "1", "--crash-at", "2"], on_line=lambda r, t: lines.append(t))
    # DeepSpeed's launcher polls its ranks once a second, in set order, and reports the first
    # failed one it sees: the killed rank (SIGKILL), or the survivor whose all-reduce its death
    # broke within that second (exit code 1). Either way the killed rank's last lines are named.
    msg = str(exc.value)
    assert msg.startswith(("the DeepSpeed launcher (a rank) failed with exit signal 9 (SIGKILL)",
                           "the DeepSpeed launcher (a rank) failed with exit code 1")), msg
    assert "[rank 1] probe rank 1 crashing at step 2 with KILL" in msg, msg
    pids = _probe_pids(lines)
    assert len(pids) == 2 and not any(_running(p) for p in pids)
    assert not (descendants() - before)
