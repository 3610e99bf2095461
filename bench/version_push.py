"""What one weight version costs on its way to a rollout worker (``distributed.rollout_workers``),
each way it can travel, side by side in one run: ``fp32`` (every tensor of the state dict in the
trainer's fp32, tied weights twice), ``fp32-once`` (tied weights once,
:func:`a3po.placement.worker_wire.tied_names`) and ``bf16-once`` (floats rounded to bf16 on the
way as well, :func:`~a3po.placement.worker_wire.version_wire`: what a run whose workers decode
from a bf16 copy sends).

    python -m bench.version_push                         # smollm2-135m-instruct (make setup-smol)
    python -m bench.version_push --model micro --reps 2  # smoke

Two processes, pinned one core each (the disaggregated placement's split; both on one core where
only one is usable), joined by the project's own gloo link
(:class:`a3po.parallel.ranks.Link`). The trainer process packs the model's state dict
(:func:`a3po.placement.worker_wire.pack_state`, each float cast to the wire's dtype in the same
pass) and broadcasts it after the version's header; the worker process receives it, unpacks it
(:func:`~a3po.placement.worker_wire.unpack_state`) and loads it into its engine's bf16 copy of
the model (``load_state_dict``, as the rollout engine does for each version). Each wire is timed
``--reps`` times after one untimed push; the two processes meet before every push, so the worker
is waiting when it starts (as its receiving thread is in a run). Medians, seconds:

* trainer: ``pack`` (cast and copy into one buffer) and ``send`` (the broadcast, until gloo hands
  the buffer back), both in a thread of the trainer process in a run, beside the update;
* worker: ``receive`` (from the header's arrival to the last byte), ``unpack``, ``engine load``:
  on the worker's core, beside the decode.

Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch

from a3po.models.factory import count_parameters, empty_like
from a3po.parallel.ranks import Link
from a3po.placement.cores import usable_core_ids
from a3po.placement.worker_wire import pack_state, packed_size, state_layout, tied_names, unpack_state
from bench.roofline import load

WIRES = {"fp32": (None, False), "fp32-once": (None, True), "bf16-once": (torch.bfloat16, True)}  # (dtype, ties once)


def _side(rank: int, core: int, model_name: str, wires: list[str], reps: int, store_path: str, out) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    model, _ = load(model_name)
    state = model.state_dict()
    link = Link(torch.distributed.FileStore(store_path, 2), "weights", [0, 1], rank)
    engine = empty_like(model, torch.bfloat16).eval() if rank == 1 else None
    meet = torch.zeros(1)
    figures: dict[str, dict[str, list[float]]] = {}
    for wire in wires:
        (dtype, once), times = WIRES[wire], figures.setdefault(wire, {})
        tied = tied_names(state) if once else {}
        layout = state_layout(state, dtype)
        nbytes = packed_size(layout, tied)
        for rep in range(reps + 1):  # the first untimed
            link.broadcast(meet, 0)
            header = torch.tensor([rep, 1], dtype=torch.int64)
            if rank == 0:
                t0 = time.perf_counter()
                buf = pack_state(state, dtype, tied)
                t1 = time.perf_counter()
                link.broadcast(header, 0)
                link.broadcast(buf, 0)
                spans = {"pack": t1 - t0, "send": time.perf_counter() - t1}
            else:
                link.broadcast(header, 0)
                t0 = time.perf_counter()
                buf = torch.empty(nbytes, dtype=torch.uint8)
                link.broadcast(buf, 0)
                t1 = time.perf_counter()
                got = unpack_state(buf, layout, torch.device("cpu"), tied)
                t2 = time.perf_counter()
                engine.load_state_dict(got)
                spans = {"receive": t1 - t0, "unpack": t2 - t1, "engine_load": time.perf_counter() - t2}
            if rep:
                for k, v in spans.items():
                    times.setdefault(k, []).append(v)
        times["mb"] = [nbytes / 2**20]
    out.put((rank, figures, count_parameters(model)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.version_push", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model.name (default smollm2-135m-instruct: make setup-smol)")
    ap.add_argument("--wires", default=",".join(WIRES), help=f"comma-separated from {list(WIRES)} (default all)")
    ap.add_argument("--reps", type=int, default=5, help="timed pushes per wire (default 5)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    wires = [w.strip() for w in args.wires.split(",") if w.strip()]
    if not wires or any(w not in WIRES for w in wires):
        ap.error(f"--wires: comma-separated from {list(WIRES)}, got {args.wires!r}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    cores = list(usable_core_ids())
    pinned = [cores[0], cores[1 % len(cores)]]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="a3po-push-") as tmp:
        procs = [ctx.Process(target=_side, args=(r, pinned[r], args.model, wires, args.reps, os.path.join(tmp, "store"),
                                                 out)) for r in (0, 1)]
        for p in procs:
            p.start()
        sides = [out.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
    got = {rank: figures for rank, figures, _ in sides}
    params = sides[0][2]
    rows = {}
    for w in wires:
        t, r = got[0][w], got[1][w]
        med = {k: statistics.median(v) for k, v in {**t, **r}.items()}
        med["trainer_s"] = med["pack"] + med["send"]
        med["worker_s"] = med["receive"] + med["unpack"] + med["engine_load"]
        rows[w] = med

    print(f"version push: model {args.model} ({params / 1e6:.1f}M parameters), trainer on core "
          f"{pinned[0]}, worker on core {pinned[1]}, one thread each; median of {args.reps}")
    head = (f"{'wire':<10} {'MiB':>7} {'pack':>7} {'send':>7} {'trainer':>8} {'receive':>8} {'unpack':>7} "
            f"{'engine load':>12} {'worker':>7}")
    print(head + "\n" + "-" * len(head))
    for w, m in rows.items():
        print(f"{w:<10} {m['mb']:>7.1f} {m['pack']:>7.3f} {m['send']:>7.3f} {m['trainer_s']:>8.3f} {m['receive']:>8.3f} "
              f"{m['unpack']:>7.3f} {m['engine_load']:>12.3f} {m['worker_s']:>7.3f}")
    first = rows[wires[0]]
    for w in wires[1:]:
        print(f"{wires[0]} / {w}: trainer {first['trainer_s'] / rows[w]['trainer_s']:.2f}x, "
              f"worker {first['worker_s'] / rows[w]['worker_s']:.2f}x")
    summary = {
        "bench": "version_push",
        "model": args.model,
        "params": params,
        "cores": pinned,
        "reps": args.reps,
        "wires": rows,
        "command": "python -m bench.version_push " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
