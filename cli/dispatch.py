"""``a3po`` command line, one tool with subcommands (``a3po --help`` lists them):

    a3po train     one variant on a preset or YAML config (``a3po/training/command.py``)
    a3po eval      a checkpoint on GSM8K / MATH500 / AIME24 (``eval/cli.py``)
    a3po compare   the comparison flow (``flows/compare_variants.py``, same options)
    a3po nightly   the nightly parity flow (``flows/nightly_parity.py``, same options)
    a3po claims    the paper-claims flow (``flows/paper_claims.py``, same options)
    a3po bench     a benchmark of ``bench/`` by name (``python -m bench.<name>``)
    a3po serve     the team-mode servers (``infra/start_*.sh``), in the foreground until stopped

Every command but ``serve`` ends with one JSON line of its key figures (``serve`` reports on
stderr and exits with the first server that stops). This package is the top of the stack (above
``bench``, ``flows``, ``tasks``, ``eval`` | ``infra`` and the library); nothing imports it. Each
subcommand still imports what it runs only when it runs, so ``a3po --help`` stays fast (no torch,
Prefect or MLflow) and a missing extra is named by the command that needs it.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable


def _train(argv: list[str]) -> int:
    from a3po.training.command import main as train_main  # the library's own command (launched ranks run it)

    return train_main(argv)


def _eval(argv: list[str]) -> int:
    from eval.cli import main as eval_main  # eval/ imports torch and the library: only when run

    return eval_main(argv)


def _compare(argv: list[str]) -> int:
    from flows.compare_variants import main as compare_main  # flows import Prefect: only when run

    return compare_main(argv, prog="a3po compare")


def _nightly(argv: list[str]) -> int:
    from flows.nightly_parity import main as nightly_main

    return nightly_main(argv, prog="a3po nightly")


def _claims(argv: list[str]) -> int:
    from flows.paper_claims import main as claims_main

    return claims_main(argv, prog="a3po claims")


def _bench(argv: list[str]) -> int:
    import bench  # the package only: its modules are found by name, and imported when run

    return bench.main(argv, prog="a3po bench")


def _serve(argv: list[str]) -> int:
    from infra.team_servers import main as serve_main

    return serve_main(argv)


# The packages each optional extra of pyproject.toml brings; `pip install -e .` alone trains
# (`a3po train`), the flows need `pipeline`, lm-eval and hub datasets `eval`.
EXTRAS: dict[str, tuple[str, ...]] = {
    "pipeline": ("prefect", "mlflow", "pandas", "matplotlib", "scipy", "psutil"),
    "eval": ("lm_eval", "datasets"),
}


def missing_extra(module: str) -> str | None:
    """The extra that brings ``module`` (a dotted name: its top package counts), or None."""
    top = module.split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def install_hint(command: str, extra: str, missing: str) -> str:
    return (f"a3po {command}: needs the '{extra}' extra (not installed: {missing}): "
            f"pip install -e '.[{extra}]' in the checkout, or pip install 'a3po[{extra}]'")


@dataclass(frozen=True)
class Command:
    summary: str  # one line in `a3po --help`
    run: Callable[[list[str]], int]
    # Extras checked before the command starts (without importing them); a module of another
    # extra missing later (`a3po eval --lm-eval`, a benchmark) is named by main() the same way.
    needs: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {
    "train": Command("train one variant (sync, recompute, loglinear) on a preset or YAML config", _train),
    "eval": Command("evaluate a checkpoint on GSM8K / MATH500 / AIME24", _eval),
    "compare": Command("compare the variants end to end (Prefect flow, tracked in MLflow)", _compare, ("pipeline",)),
    "nightly": Command("nightly convergence parity of loglinear vs recompute and sync (exit 1 on fail)", _nightly,
                       ("pipeline",)),
    "claims": Command("the A-3PO paper's claims on this testbed: paper figure, ours, verdict (Prefect flow)", _claims,
                      ("pipeline",)),
    "bench": Command("run a benchmark of bench/ by name (a3po bench --help lists them)", _bench),
    "serve": Command("team-mode servers: MLflow on PostgreSQL and the Prefect server (infra/)", _serve,
                     ("pipeline",)),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return ("usage: a3po <command> [options]     (a3po <command> --help: its options)\n\n"
            "Asynchronous RL post-training: sync, recompute and loglinear (A-3PO).\n\ncommands:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"{usage()}\n\na3po: error: {got}", file=sys.stderr)
        return 2
    command = COMMANDS[argv[0]]
    for extra in command.needs:
        absent = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
        if absent:
            print(install_hint(argv[0], extra, ", ".join(absent)), file=sys.stderr)
            return 2
    from a3po.storage.runlock import RunFolderBusy

    try:
        return command.run(argv[1:])
    except RunFolderBusy as e:  # another process writes this run folder: say who, change nothing
        print(f"a3po {argv[0]}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # a package of an extra, reached only on this command's path
        extra = missing_extra(e.name or "")
        if extra is None:
            raise
        print(install_hint(argv[0], extra, e.name), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
