"""A small real torch.distributed program for testing launches: ``python -m tests.support.launch_probe``.

Every rank joins the process group (gloo, from the launcher's RANK / WORLD_SIZE / MASTER_ADDR
/ MASTER_PORT), then per step all-reduces its rank and prints one line; rank 0 checkpoints
the step counter to ``--ckpt`` (atomic rename) and a re-run resumes from it. ``--crash-rank R
--crash-at S`` makes rank R die at step S: ``--crash-signal KILL`` (SIGKILL to itself, as an
OOM killer would) or an exit code (``--crash-signal 3``). Its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.launch_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--ckpt", default=None, help="counter file written by rank 0 after each step")
    ap.add_argument("--crash-rank", type=int, default=None)
    ap.add_argument("--crash-at", type=int, default=1, help="step at which --crash-rank dies")
    ap.add_argument("--crash-signal", default="KILL", help="KILL, TERM, ... or an exit code")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.ckpt) if args.ckpt else None
    start = int(ckpt.read_text()) if ckpt and ckpt.exists() else 0
    print(f"probe rank {rank}/{world} pid {os.getpid()} local_rank {os.environ.get('LOCAL_RANK')} start {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        if rank == args.crash_rank and step == args.crash_at:
            print(f"probe rank {rank} crashing at step {step} with {args.crash_signal}", flush=True)
            if args.crash_signal.isdigit():
                os._exit(int(args.crash_signal))
            os.kill(os.getpid(), getattr(signal, f"SIG{args.crash_signal}"))
            time.sleep(60)  # a signal that does not kill: wait to be stopped
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)  # sum of ranks = world (world - 1) / 2
        print(f"probe rank {rank} step {step} allreduce {t.item():g}", flush=True)
        print(f"probe rank {rank} step {step} stderr", file=sys.stderr, flush=True)
        if rank == 0 and ckpt:
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, ckpt)
        time.sleep(args.sleep)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world_size": world, "steps": args.steps, "resumed_from": start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
