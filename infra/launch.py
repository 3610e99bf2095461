"""Start training ranks with torchrun or the DeepSpeed launcher, stream their output, stop them all.

A :class:`LaunchSpec` says how a command runs: ``local`` (in-process, no launcher: what the
flows do by default), ``torchrun`` (``python -m torch.distributed.run``, one launcher per node)
or ``deepspeed`` (the DeepSpeed launcher: a hostfile, ssh/pdsh to the other nodes). :func:`launch`
runs a ``python`` argument list (``["-m", "a3po.training.command", ...]`` or ``["script.py", ...]``)
under it and

- streams every output line of every rank to ``on_line(rank, text)`` as it comes (torchrun:
  ``--tee 3`` prefixes lines with ``[default<local rank>]:``; DeepSpeed: per-rank log files,
  ``--enable_each_rank_log``, tailed here); launcher lines come with rank ``None``;
- starts each launcher in its own session, remembers every descendant process, and when any
  launcher fails stops the rest (SIGTERM, then SIGKILL after ``grace_s``), so nothing is left
  running, and raises :class:`RankFailure` naming the failing rank, its exit code or signal and
  its last output lines (torchrun's "Root Cause" summary, parsed).

``nodes`` lists the node ranks this call starts: on a cluster each node runs its own launcher
(its ``node_rank``); ``nodes=(0, 1)`` with ``master_addr=127.0.0.1`` runs a two-"node" job on
one machine (a loopback test of the multi-node path). Nothing here uses ssh itself; multi-host
jobs from one command are the DeepSpeed launcher's (hostfile + pdsh/ssh), see docs/distributed.md.
It needs only psutil and the standard library (no Prefect, no MLflow, not even ``a3po``): ``tasks/launch.py``
wraps it as a task, the flows build their :class:`LaunchSpec` with :func:`launch_spec`, and ``bench``
calls :func:`launch` directly.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

PROJECT_ROOT = Path(__file__).resolve().parents[1]

LineCallback = Callable[["int | None", str], None]


class LaunchMode(str, Enum):
    LOCAL = "local"  # in-process (threads), no launcher
    TORCHRUN = "torchrun"
    DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class LaunchSpec:
    """How ranks are started. Checked when built: errors name the field (``launch.<field>``)."""

    mode: LaunchMode = LaunchMode.LOCAL
    # torchrun: processes per node, node count, this node's rank, nodes started by this call.
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    nodes: tuple[int, ...] | None = None  # default (node_rank,); (0, 1) = loopback two-node test
    master_addr: str = "127.0.0.1"  # rank 0's host
    master_port: int | None = None  # None: a free local port (only when every node is started here)
    # DeepSpeed launcher: MPI-style hostfile ("host slots=N"), top N hosts, slots per host, or
    # an explicit resource filter ("host-0@host-1:0,2"; not with num_nodes / num_gpus).
    hostfile: str | None = None
    num_nodes: int | None = None
    num_gpus: int | None = None
    include: str | None = None
    # Recorded with the run (topology), and DS_ACCELERATOR=cpu for the ranks on "cpu".
    devices: str = "cpu"  # cpu | cuda
    zero_stage: int | None = None  # ZeRO stage of the DeepSpeed config the ranks use, 0-3
    grace_s: float = 10.0  # SIGTERM -> SIGKILL when stopping

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", LaunchMode(self.mode))
        except ValueError:
            raise ValueError(f"launch.mode must be one of {[m.value for m in LaunchMode]}, got {self.mode!r}") from None
        if self.nodes is not None:
            object.__setattr__(self, "nodes", tuple(self.nodes))
        for name in ("nproc_per_node", "nnodes"):
            _check_int(name, getattr(self, name), low=1)
        _check_int("node_rank", self.node_rank, low=0, high=self.nnodes - 1, why=f"< launch.nnodes = {self.nnodes}")
        for name in ("num_nodes", "num_gpus"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=1)
        if self.zero_stage is not None:
            _check_int("zero_stage", self.zero_stage, low=0, high=3)
        if self.master_port is not None:
            _check_int("master_port", self.master_port, low=1, high=65535)
        if self.devices not in ("cpu", "cuda"):
            raise ValueError(f"launch.devices must be 'cpu' or 'cuda', got {self.devices!r}")
        if not isinstance(self.grace_s, (int, float)) or self.grace_s < 0:
            raise ValueError(f"launch.grace_s must be a number >= 0, got {self.grace_s!r}")
        if not self.master_addr or not isinstance(self.master_addr, str):
            raise ValueError(f"launch.master_addr must be a host name or address, got {self.master_addr!r}")
        self._check_mode_fields()

    def _check_mode_fields(self) -> None:
        torchrun_only = {"nproc_per_node": 1, "nnodes": 1, "node_rank": 0, "nodes": None}
        deepspeed_only = {"hostfile": None, "num_nodes": None, "num_gpus": None, "include": None}
        if self.mode is LaunchMode.LOCAL:
            for name, default in {**torchrun_only, **deepspeed_only}.items():
                if getattr(self, name) != default:
                    raise ValueError(f"launch.{name} is set but launch.mode is 'local' (no launcher); use torchrun or deepspeed")
            return
        if self.mode is LaunchMode.TORCHRUN:
            for name in deepspeed_only:
                if getattr(self, name) is not None:
                    raise ValueError(f"launch.{name} is a DeepSpeed launcher option; launch.mode is 'torchrun'")
            nodes = self.local_nodes
            if len(set(nodes)) != len(nodes) or not nodes:
                raise ValueError(f"launch.nodes must list distinct node ranks, got {list(nodes)}")
            bad = [n for n in nodes if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < self.nnodes]
            if bad:
                raise ValueError(f"launch.nodes: node ranks {bad} are outside [0, launch.nnodes = {self.nnodes})")
            if self.master_port is None and len(nodes) < self.nnodes:
                raise ValueError("launch.master_port is required when other nodes start their own torchrun "
                                 "(launch.nodes does not cover launch.nnodes)")
            return
        for name, default in torchrun_only.items():
            if getattr(self, name) != default:
                raise ValueError(f"launch.{name} is a torchrun option; launch.mode is 'deepspeed' (use num_nodes / num_gpus / include)")
        if self.include is not None and (self.num_nodes is not None or self.num_gpus is not None):
            # The DeepSpeed launcher refuses the combination ("Cannot specify num_nodes/gpus with include/exclude").
            raise ValueError("launch.include cannot be combined with launch.num_nodes / launch.num_gpus")
        if self.hostfile is not None:
            hosts = read_hostfile(self.hostfile)
            if self.num_nodes is not None and self.num_nodes > len(hosts):
                raise ValueError(f"launch.num_nodes = {self.num_nodes} but hostfile {self.hostfile} lists {len(hosts)} host(s)")
        elif (self.num_nodes or 1) > 1:
            raise ValueError("launch.num_nodes > 1 needs launch.hostfile (the DeepSpeed launcher reaches other nodes through it)")

    @property
    def local_nodes(self) -> tuple[int, ...]:
        """Node ranks whose launcher this call starts (one launcher for DeepSpeed)."""
        return self.nodes if self.nodes is not None else (self.node_rank,)

    def topology(self) -> dict[str, Any]:
        """What the run is spread over, for the record (None where the launcher decides)."""
        nodes, per_node = self.nnodes, self.nproc_per_node
        if self.mode is LaunchMode.DEEPSPEED:
            hosts = read_hostfile(self.hostfile) if self.hostfile else {"localhost": None}
            nodes = self.num_nodes or (len(self.include.split("@")) if self.include else len(hosts))
            slots = {s for s in hosts.values() if s is not None}
            per_node = self.num_gpus or (slots.pop() if len(slots) == 1 and not self.include else None)
        world = nodes * per_node if per_node else None
        return {"mode": self.mode.value, "nodes": nodes, "ranks_per_node": per_node, "world_size": world,
                "devices": self.devices, "zero_stage": self.zero_stage}


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"launch.{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = why or (f"in [{low}, {high}]" if high is not None else f">= {low}")
        raise ValueError(f"launch.{name} must be {bounds}, got {value}")


def read_hostfile(path: str | Path) -> dict[str, int]:
    """``{host: slots}`` from an MPI-style hostfile (``host slots=N``, ``#`` comments); errors
    name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"launch.hostfile: {p} does not exist")
    hosts: dict[str, int] = {}
    for i, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"{p}:{i}: expected '<host> slots=<N >= 1>', got {raw!r}")
        if m.group(1) in hosts:
            raise ValueError(f"{p}:{i}: host {m.group(1)!r} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise ValueError(f"{p}: no hosts listed")
    return hosts


def launch_spec(value: "str | Mapping[str, Any] | LaunchSpec | None") -> LaunchSpec:
    """A spec from a flow parameter: a mode name (``"torchrun"``), a dict of fields, or a spec."""
    if isinstance(value, LaunchSpec):
        return value
    if value is None or isinstance(value, str):
        return LaunchSpec(mode=value or "local")
    if not isinstance(value, Mapping):
        raise ValueError(f"launch must be a mode name or a mapping of LaunchSpec fields, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(LaunchSpec)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"launch: unknown field(s) {unknown}; valid: {sorted(known)}")
    return LaunchSpec(**value)


# --- command lines --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _program(argv: list[str], module_flag: str) -> list[str]:
    """``["-m", mod, *args]`` -> ``[module_flag, mod, *args]``; a script path stays as it is."""
    if not argv:
        raise ValueError("launch: empty program (expected ['-m', 'module', ...] or ['script.py', ...])")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("launch: '-m' without a module name")
        return [module_flag, *argv[1:]]
    return list(argv)


def launcher_commands(spec: LaunchSpec, argv: list[str], master_port: int, rank_log_dir: str | Path | None = None) -> dict[int, list[str]]:
    """``{node rank: command}``, one launcher per node started by this call."""
    py = sys.executable
    if spec.mode is LaunchMode.TORCHRUN:
        return {
            node: [py, "-m", "torch.distributed.run", "--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node),
                   "--node-rank", str(node), "--master-addr", spec.master_addr, "--master-port", str(master_port),
                   # --tee 3: stdout + stderr of every rank, prefixed "[default<local rank>]:"; no restarts (a
                   # failed rank fails the launch, the flow's retry resumes from the checkpoint instead).
                   "--tee", "3", "--max-restarts", "0", *_program(argv, "-m")]
            for node in spec.local_nodes
        }
    if spec.mode is LaunchMode.DEEPSPEED:
        cmd = [py, "-m", "deepspeed.launcher.runner"]  # = the `deepspeed` script of this environment
        for flag, val in (("--hostfile", spec.hostfile), ("--num_nodes", spec.num_nodes), ("--num_gpus", spec.num_gpus), ("--include", spec.include)):
            if val is not None:
                cmd += [flag, str(val)]
        if spec.hostfile is not None:
            cmd += ["--master_addr", spec.master_addr]
        cmd += ["--master_port", str(master_port),
                # The ranks read LOCAL_RANK from the environment; a --local_rank argument would be an unknown option.
                "--no_local_rank"]
        if rank_log_dir is not None:
            cmd.append(f"--enable_each_rank_log={rank_log_dir}")
        return {0: cmd + _program(argv, "--module")}
    raise ValueError("launch.mode 'local' runs in-process: there is no launcher command")


# --- running --------------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """A rank (or a launcher) died; the others were stopped."""

    def __init__(self, message: str, rank: int | None, exitcode: int | None, last_lines: list[str]) -> None:
        super().__init__(message)
        self.rank, self.exitcode, self.last_lines = rank, exitcode, last_lines


@dataclass
class LaunchResult:
    topology: dict[str, Any]
    commands: dict[int, list[str]]
    exit_codes: dict[int, int]  # per node launcher
    wall_s: float
    lines: dict[str, int] = field(default_factory=dict)  # lines seen per rank ("launcher" for rank None)


def exit_description(code: int | None) -> str:
    """``-9`` -> ``"exit signal 9 (SIGKILL)"``; ``1`` -> ``"exit code 1"``."""
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"exit signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit signal {-code}"
    return f"exit code {code}"


_TORCHRUN_LINE = re.compile(r"^\[default(\d+)\]:(.*)$")
# torchrun's ChildFailedError summary: the block after "Root Cause" names the global rank and exit code.
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)


class _Run:
    """The launchers of one call, their output and their descendants."""

    def __init__(
        self, spec: LaunchSpec, commands: dict[int, list[str]], env: dict[str, str], cwd: str | None, on_line: LineCallback | None, tail: int
    ) -> None:
        self.spec, self.on_line = spec, on_line
        self.tail: dict[int | None, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=tail))
        self.counts: collections.Counter = collections.Counter()
        self.launcher_text: dict[int, list[str]] = collections.defaultdict(list)
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.known: dict[int, psutil.Process] = {}  # every descendant seen, by pid
        self.readers: list[threading.Thread] = []
        for node, cmd in commands.items():
            # Own session: the launcher and its group are signalled together, never our own process.
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env, cwd=cwd, start_new_session=True, text=True, bufsize=1, errors="replace")
            self.procs[node] = p
            t = threading.Thread(target=self._read, args=(node, p), daemon=True, name=f"launch-node{node}")
            t.start()
            self.readers.append(t)

    def emit(self, rank: int | None, text: str) -> None:
        with self.lock:
            self.tail[rank].append(text)
            self.counts["launcher" if rank is None else f"rank{rank}"] += 1
        if self.on_line is not None:
            self.on_line(rank, text)

    def _read(self, node: int, p: subprocess.Popen) -> None:
        for raw in p.stdout:
            line = raw.rstrip("\n")
            m = _TORCHRUN_LINE.match(line) if self.spec.mode is LaunchMode.TORCHRUN else None
            if m:
                self.emit(node * self.spec.nproc_per_node + int(m.group(1)), m.group(2))
            else:
                with self.lock:
                    self.launcher_text[node].append(line)
                self.emit(None, line)

    def watch_descendants(self) -> None:
        """Remember every process below the launchers: torchrun starts its workers in new
        sessions, so only this list reaches them if a launcher dies first."""
        for p in self.procs.values():
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    self.known.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM every launcher group and descendant, SIGKILL what is left after ``grace_s``."""
        self.watch_descendants()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs.values():
                if p.poll() is None or sig is signal.SIGKILL:
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            for proc in list(self.known.values()):
                try:
                    if proc.is_running():  # also checks the pid was not reused (create time)
                        proc.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            if sig is signal.SIGTERM:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and (any(p.poll() is None for p in self.procs.values()) or self._alive()):
                    time.sleep(0.05)
        for p in self.procs.values():
            p.wait()
        psutil.wait_procs(list(self.known.values()), timeout=5)

    def _alive(self) -> bool:
        return any(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE for proc in self.known.values() if _exists(proc))

    def failure(self, node: int, code: int) -> RankFailure:
        """The failing rank from torchrun's root-cause summary, else the launcher itself."""
        with self.lock:
            text = "\n".join(self.launcher_text[node])
        m = _ROOT_CAUSE.search(text)
        if m:
            rank, local, rc = int(m.group(1)), int(m.group(2)), int(m.group(3))
            where = f"node {node}, local rank {local}"
        elif self.spec.mode is LaunchMode.DEEPSPEED:
            # It exits with its failing rank's code (sys.exit(-9) -> 247) but does not say which rank.
            rank, rc, where = None, code - 256 if code > 128 else code, "DeepSpeed launcher (a rank)"
        else:
            rank, rc, where = None, code, f"launcher of node {node}"
        with self.lock:
            lines = list(self.tail[rank]) if rank is not None else list(self.tail[None])
            others = {r: list(t)[-3:] for r, t in self.tail.items() if r is not None and r != rank}
        who = f"rank {rank} ({where})" if rank is not None else f"the {where}"
        msg = f"{who} failed with {exit_description(rc)}; the other ranks were stopped.\nlast output lines of {who}:\n" + \
              "\n".join(f"  {ln}" for ln in lines[-20:])
        if rank is None and others:
            msg += "\nlast lines per rank:\n" + "\n".join(f"  [rank {r}] {ln}" for r, ls in sorted(others.items()) for ln in ls)
        return RankFailure(msg, rank, rc, lines)


def _exists(proc: psutil.Process) -> bool:
    try:
        return proc.is_running()
    except psutil.Error:
        return False


def _tail_rank_logs(run: _Run, log_dir: Path, stop: threading.Event) -> None:
    """Stream the DeepSpeed launcher's per-rank log files (``<time>_rank<N>.log``) line by line."""
    files: dict[Path, Any] = {}
    partial: dict[Path, str] = {}
    while True:
        done = stop.is_set()
        for path in sorted(log_dir.glob("*_rank*.log")):
            if path not in files:
                files[path] = open(path, errors="replace")
                partial[path] = ""
            rank = int(re.search(r"_rank(\d+)\.log$", path.name).group(1))
            chunk = files[path].read()
            if chunk:
                text = partial[path] + chunk
                *complete, partial[path] = text.split("\n")
                for line in complete:
                    run.emit(rank, line)
            if done and partial[path]:
                run.emit(rank, partial[path])
                partial[path] = ""
        if done:
            break
        time.sleep(0.1)
    for f in files.values():
        f.close()


def launch(
    spec: LaunchSpec,
    argv: list[str],
    on_line: LineCallback | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    rank_log_dir: str | Path | None = None,
    tail_lines: int = 30,
    poll_s: float = 0.1,
) -> LaunchResult:
    """Run ``python <argv>`` as the ranks of ``spec``; see the module docstring. ``env`` is laid
    over this process's environment (the project root is put first on ``PYTHONPATH`` so the
    ranks import the same code); ``rank_log_dir`` is where the DeepSpeed launcher's per-rank
    logs go (default: a fresh temporary folder)."""
    if spec.mode is LaunchMode.LOCAL:
        raise ValueError("launch.mode 'local' runs in-process (no launcher); call the library directly")
    port = spec.master_port or free_port()
    log_dir = None
    if spec.mode is LaunchMode.DEEPSPEED:
        import tempfile

        log_dir = Path(rank_log_dir or tempfile.mkdtemp(prefix="a3po-ds-ranks-"))
        log_dir.mkdir(parents=True, exist_ok=True)
    commands = launcher_commands(spec, argv, port, log_dir)
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, [full_env.get("PYTHONPATH")])])
    full_env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    if spec.devices == "cpu":
        full_env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    run = _Run(spec, commands, full_env, str(cwd) if cwd else None, on_line, tail_lines)
    stop_tail = threading.Event()
    tailer = None
    if log_dir is not None:
        tailer = threading.Thread(target=_tail_rank_logs, args=(run, log_dir, stop_tail), daemon=True, name="launch-rank-logs")
        tailer.start()
    failed: tuple[int, int] | None = None
    try:
        while True:
            run.watch_descendants()
            codes = {node: p.poll() for node, p in run.procs.items()}
            bad = [(node, c) for node, c in codes.items() if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes.values()):
                break
            time.sleep(poll_s)
    finally:
        # Always: a failure, an exception or an interrupt here must not leave ranks behind.
        run.stop(spec.grace_s if failed is None else min(spec.grace_s, 5.0))
        for t in run.readers:
            t.join(timeout=10)
        stop_tail.set()
        if tailer is not None:
            tailer.join(timeout=10)
    exit_codes = {node: p.returncode for node, p in run.procs.items()}
    if failed is not None:
        raise run.failure(*failed)
    return LaunchResult(spec.topology(), commands, exit_codes, time.perf_counter() - t0, dict(run.counts))
