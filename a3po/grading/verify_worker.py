"""The math-verify worker: symbolic answer equivalence in a process that can be killed.

Why a process: sympy can hang (``10^{10^{10^{10}}}`` makes it build a number with ten billion
digits, inside C code that no Python signal interrupts), and math-verify's own timeout is
``signal.alarm``, which only works in the main thread of the main interpreter. The RL trainer
and the evaluation runner call the grader from threads and worker processes, so math-verify's
timeouts are passed as disabled here and the bound is enforced from outside, by SIGKILL.

Layout (three processes)::

    caller (a3po.grading.verifier.Verifier) --pipe--> supervisor (this file, run as a script)
                                                   |  fork()
                                                   v
                                              evaluator child: parse + verify

The supervisor imports math-verify once (about a second) and never runs sympy itself, so it
never hangs. It forwards each request to its forked child and waits at most the request's
timeout; on expiry it SIGKILLs the child and forks a fresh one, which is ready in milliseconds
because the imports are already in memory (fork from a single-threaded process is safe). The
caller only has to bound its wait on the supervisor, which always answers.

Each evaluator child also runs under an address-space limit, so a blow-up ends in MemoryError
rather than in the machine swapping. math-verify (and sympy under it) catch ``Exception`` around
each parsing and comparison strategy and answer "not equal", and MemoryError is an Exception, so
a starved evaluator would give zeros that look like decisions. So in the child a failed
allocation raises a BaseException instead, which those handlers let through (or, where the
interpreter does not allow that, a trace function watches for MemoryError: ``_MemoryWatch``):
an allocation failure anywhere makes the reply an error, never a verdict, and the supervisor
replaces the child (its caches may hold what a starved parse left).

Protocol: frames of a 4-byte big-endian length plus UTF-8 JSON. Requests ``{"g": gold, "p":
prediction, "t": timeout_s}``; replies ``{"ok": bool, "timeout": bool, "err": str | None,
"mem": bool}`` (``mem``: the evaluator ran short of memory; ``err`` then says so).
The supervisor first checks its evaluator on ``1/2 == 0.5`` and sends ``{"ready": true}``, or
``{"ready": false, "error": why}`` and exits. This file imports only the standard library
and math-verify, and is started by path, so it works wherever the caller runs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import time
from functools import lru_cache

_HEADER = struct.Struct(">I")


# ---------------------------------------------------------------- equivalence (runs in the child)


def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # boxed_match_priority=0: a \boxed{} wrapper is the answer itself, tried before anything else.
    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _parse(answer: str) -> list:
    """math-verify parse of one bare answer. The answer is wrapped as ``$\\boxed{...}$`` so
    LaTeX like ``\\left( 3, \\frac{\\pi}{2} \\right)`` or ``\\text{Evelyn}`` is read as one
    expression; when that yields nothing the raw text is tried (``1/2``, ``x = 5``)."""
    from math_verify import parse

    cfg = _configs()
    found = parse(f"$\\boxed{{{answer}}}$", cfg, parsing_timeout=None)
    return found or parse(answer, cfg, parsing_timeout=None)


@lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> list:
    # Golds repeat (n samples per problem, many epochs of the same prompts): parse each once.
    return _parse(gold)


class GoldNotParsed(ValueError):
    pass


GOLD_NOT_PARSED = "math-verify could not parse the gold"  # how its error reads to callers


def equivalent(gold: str, pred: str) -> bool:
    """True when math-verify finds ``pred`` equal to ``gold`` (both bare answers, not completions);
    raises ``GoldNotParsed`` when the gold cannot be read (a bad gold, or an evaluator short of
    memory). No timeout: call it only where something else can kill the process."""
    from math_verify import verify

    g = _parse_gold(gold)
    if not g:  # math-verify swallows its errors (MemoryError included): an unread gold decides nothing
        raise GoldNotParsed(f"{GOLD_NOT_PARSED} {gold[:80]!r}")
    p = _parse(pred)
    if not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


class Starved(MemoryError):
    """A MemoryError was raised during the call, even if math-verify caught it."""


class _OutOfMemory(BaseException):
    """What a failed allocation raises in the evaluator instead of MemoryError (see
    ``_uncatchable_memory_errors``): a BaseException, so ``except Exception`` lets it through."""

    created = [False]  # preallocated: set on creation, even if a bare ``except:`` swallows it later

    def __init__(self, *args) -> None:  # BaseException.__new__ has stored args already
        _OutOfMemory.created[0] = True


def _uncatchable_memory_errors() -> bool:
    """Make CPython raise ``_OutOfMemory`` where it would raise MemoryError (a failed allocation,
    in C or Python code), in this process: it writes the class into the interpreter's
    ``PyExc_MemoryError`` pointer, which every allocation failure reads. For the evaluator child
    only (a fork that does nothing else). False where it cannot (not CPython, no ctypes)."""
    try:
        import ctypes

        slot = ctypes.c_void_p.in_dll(ctypes.pythonapi, "PyExc_MemoryError")
    except (ImportError, AttributeError, ValueError, OSError):
        return False
    if slot.value != id(MemoryError):  # not the interpreter layout this relies on
        return False
    slot.value = id(_OutOfMemory)  # the class lives as long as this module: the borrowed pointer stays valid
    return True


class _MemoryWatch:
    """Sees every allocation failure during ``run``, including those that math-verify or sympy
    would catch (``except Exception``) and turn into "not equal" or "no parse".

    Two ways, the first where it works:

    - ``_uncatchable_memory_errors``: failed allocations raise ``_OutOfMemory``, which no
      ``except Exception`` catches; one swallowed by a bare ``except:`` is still seen, since
      creating it sets a flag. Costs nothing per call.
    - otherwise ``sys.settrace``: an "exception" event in every frame that a MemoryError passes
      through, the catching frame included (line events off). Costs 2-3x the evaluator's time
      on symbolic comparisons (1.9x on bench.grading's fixtures, 2.7x on real MATH answers).
      The tracer allocates nothing; if calling it fails for lack of memory, CPython removes
      it, which ``run`` reports too.
    """

    def __init__(self, uncatchable: bool) -> None:
        self.traced = not uncatchable
        self.seen = [False]  # preallocated: setting the flag must not need memory

        def on_frame_event(frame, event, arg, seen=self.seen):
            if event == "exception" and issubclass(arg[0], MemoryError):
                seen[0] = True
            return on_frame_event

        def on_call(frame, event, arg):
            frame.f_trace_lines = False
            return on_frame_event

        self._on_call = on_call

    def run(self, fn, *args):
        """``fn(*args)``; raises :class:`Starved` when an allocation failed inside it, caught or
        not (an unparsed gold under starvation is starvation, not a bad gold)."""
        self.seen[0] = _OutOfMemory.created[0] = False
        if self.traced:
            sys.settrace(self._on_call)
        try:
            out, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the watch is off
            out, error = None, e
        lost = self.traced and sys.gettrace() is not self._on_call  # the tracer failed for lack of memory
        if self.traced:
            sys.settrace(None)
        if isinstance(error, (MemoryError, _OutOfMemory)):
            raise Starved("MemoryError") from error
        if self.seen[0] or _OutOfMemory.created[0] or lost:
            where = "caught inside math-verify" if not lost else "in the memory watch"
            raise Starved(f"MemoryError {where}") from error
        if error is not None:
            raise error
        return out


# ---------------------------------------------------------------- framing


def write_frame(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    buf = memoryview(_HEADER.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks: list[bytes] = []
    while n > 0:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None  # EOF: the other side is gone
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> dict | None:
    """Next frame from ``fd``; None at EOF; TimeoutError once ``time.monotonic()`` passes ``deadline``."""
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0], deadline)
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------- supervisor and child


class _Child:
    """A forked evaluator with a request pipe and a reply pipe."""

    def __init__(self, memory_limit_mb: int, close_in_child: tuple[int, ...]) -> None:
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # evaluator child
            try:
                for fd in (*close_in_child, self.req_w, self.resp_r):
                    os.close(fd)
                uncatchable = _uncatchable_memory_errors()  # before the limit: it imports ctypes
                _limit_memory(memory_limit_mb)
                _evaluate_forever(req_r, resp_w, uncatchable)
            finally:
                os._exit(0)
        self.pid = pid
        os.close(req_r)
        os.close(resp_w)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self.req_w)
        os.close(self.resp_r)


def _limit_memory(memory_limit_mb: int) -> None:
    if memory_limit_mb <= 0:
        return
    try:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass  # best effort: the timeout still bounds the call


def _evaluate_forever(req_r: int, resp_w: int, uncatchable: bool) -> None:
    watch = _MemoryWatch(uncatchable)
    while True:
        req = read_frame(req_r)
        if req is None:
            return
        try:
            reply = {"ok": watch.run(equivalent, req["g"], req["p"]), "timeout": False, "err": None, "mem": False}
        except (Starved, _OutOfMemory) as e:  # no verdict (an _OutOfMemory here: even Starved found no memory)
            reply = {"ok": False, "timeout": False, "err": f"{str(e) or 'MemoryError'} (evaluator short of memory)",
                     "mem": True}
        except BaseException as e:  # noqa: BLE001 - RecursionError, sympy internals
            err = str(e) if isinstance(e, GoldNotParsed) else type(e).__name__
            reply = {"ok": False, "timeout": False, "err": err, "mem": False}
        write_frame(resp_w, reply)


def _self_check(child: _Child, memory_limit_mb: int, timeout_s: float = 60.0) -> str | None:
    """None when the evaluator, under its memory limit, finds 1/2 equal to 0.5; else why not.

    Why: math-verify catches its own exceptions (a MemoryError included) and returns "not
    equal", so an evaluator that cannot work would score every answer 0 without an error."""
    try:
        write_frame(child.req_w, {"g": "\\frac{1}{2}", "p": "0.5", "t": timeout_s})
        reply = read_frame(child.resp_r, time.monotonic() + timeout_s)
    except (TimeoutError, OSError):
        reply = None
    if reply is not None and reply.get("ok"):
        return None
    detail = "no reply" if reply is None else (reply.get("err") or "answered 'not equal'")
    return (
        f"the evaluator failed its self-check (1/2 == 0.5: {detail}) under a memory limit of "
        f"{memory_limit_mb} MB (GradingConfig.memory_limit_mb; 0 = none)"
    )


def serve(in_fd: int, out_fd: int, memory_limit_mb: int) -> None:
    """The supervisor loop: answer every request within its timeout, whatever the child does."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" is by design
    equivalent("1", "1")  # import latex2sympy, antlr and sympy before forking: children start warm
    import ctypes  # noqa: F401 - likewise for _uncatchable_memory_errors in each child
    child = _Child(memory_limit_mb, (in_fd, out_fd))
    problem = _self_check(child, memory_limit_mb)
    if problem is not None:
        child.kill()
        write_frame(out_fd, {"ready": False, "error": problem})
        return
    write_frame(out_fd, {"ready": True, "pid": os.getpid()})
    try:
        while True:
            req = read_frame(in_fd)
            if req is None:
                return  # the caller closed the pipe or died
            timeout_s = float(req.get("t", 5.0))
            try:
                write_frame(child.req_w, req)
                reply = read_frame(child.resp_r, time.monotonic() + timeout_s)
                if reply is None:
                    raise ChildProcessError
            except TimeoutError:
                reply = {"ok": False, "timeout": True, "err": None}
                child.kill()
                child = _Child(memory_limit_mb, (in_fd, out_fd))
            except (ChildProcessError, OSError, ValueError):  # ValueError: a reply that is not JSON
                reply = {"ok": False, "timeout": False, "err": "evaluator died"}
                child.kill()
                child = _Child(memory_limit_mb, (in_fd, out_fd))
            else:
                if reply.get("mem"):  # a fresh fork: nothing a starved call cached survives it
                    child.kill()
                    child = _Child(memory_limit_mb, (in_fd, out_fd))
            write_frame(out_fd, reply)
    finally:
        child.kill()


def main(argv: list[str]) -> None:
    memory_limit_mb = int(argv[0]) if argv else 2048
    # Frames go to a private copy of stdout; fd 1 then points at stderr, so anything a library
    # prints cannot corrupt the protocol.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the caller's terminal is the caller's
    serve(0, out_fd, memory_limit_mb)


if __name__ == "__main__":
    main(sys.argv[1:])
