"""The ``a3po`` tool (the ``cli`` package, ``python -m cli``): its subcommands listed by ``a3po
--help`` without importing the stack, ``a3po train`` as the library's ``a3po.training.command``,
the flows' own options under ``a3po compare`` / ``a3po nightly``, ``a3po bench`` finding and
running benchmark modules by name, ``a3po serve`` running the scripts of ``infra/``. Seconds.

The servers started by ``a3po serve`` are stand-in scripts here (PostgreSQL and two servers take
minutes); the real scripts are exercised by ``infra/ci_team_mode.sh``. What is tested is the
wrapper: which scripts it finds, the ports it passes, how it stops them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bench
import cli.dispatch
from cli import main

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["train", "eval", "compare", "nightly", "claims", "bench", "serve"]


def _a3po(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_every_subcommand_in_one_line_without_importing_the_stack():
    probe = ("import sys; from cli import main; main(['--help']); "
             "print(sorted(m for m in ('prefect', 'mlflow', 'torch', 'flows') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *help_lines, imported = proc.stdout.strip().splitlines()
    assert imported == "[]"  # `a3po --help` stays fast
    listed = [line.split()[0] for line in help_lines[help_lines.index("commands:") + 1 :]]
    assert listed == SUBCOMMANDS
    assert all(len(line.split()) > 3 for line in help_lines[help_lines.index("commands:") + 1 :])  # each with its line


def test_module_docstring_lists_every_subcommand_in_order():
    listed = [line.split()[1] for line in cli.dispatch.__doc__.splitlines() if line.startswith("    a3po ")]
    assert listed == list(cli.dispatch.COMMANDS) == SUBCOMMANDS


def test_train_is_the_librarys_command_under_its_own_name(capsys):
    # `a3po train ...` and `python -m a3po.training.command ...` (what launched ranks run) are one parser.
    from a3po.training.command import main as train_main

    for run in (lambda: main(["train", "--help"]), lambda: train_main(["--help"])):
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: a3po train ") and "--preset" in out and "--no-progress" in out


def test_unknown_or_missing_subcommand_exits_2(capsys):
    assert main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err
    assert main([]) == 2


@pytest.mark.parametrize("command", ["compare", "nightly", "claims", "serve"])
def test_pipeline_commands_without_the_pipeline_extra_fail_in_one_line_naming_it(command, monkeypatch, capsys):
    real = cli.dispatch.importlib.util.find_spec
    monkeypatch.setattr(cli.dispatch.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("prefect", "mlflow") else real(name, *a))
    assert main([command, "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"a3po {command}: needs the 'pipeline' extra (not installed: prefect, mlflow): "
                   "pip install -e '.[pipeline]' in the checkout, or pip install 'a3po[pipeline]'"]


def test_a_module_of_an_extra_missing_mid_command_is_named_with_its_extra(monkeypatch, capsys):
    def run(argv):
        raise ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval.tasks")

    monkeypatch.setitem(cli.dispatch.COMMANDS, "eval", cli.dispatch.Command("stand-in", run))
    assert main(["eval"]) == 2
    assert capsys.readouterr().err.startswith("a3po eval: needs the 'eval' extra (not installed: lm_eval.tasks)")

    def broken(argv):  # not a package of an extra: a real bug, with its traceback
        raise ModuleNotFoundError("No module named 'a3po.gone'", name="a3po.gone")

    monkeypatch.setitem(cli.dispatch.COMMANDS, "eval", cli.dispatch.Command("stand-in", broken))
    with pytest.raises(ModuleNotFoundError):
        main(["eval"])


@pytest.mark.parametrize("command", ["compare", "nightly", "claims"])
def test_flow_subcommands_take_the_flows_own_options(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: a3po {command} ")
    for option in ("--preset", "--config", "--steps", "--seeds", "--output-dir", "--set", "--tracking-uri"):
        assert option in out, option


def test_bench_lists_the_modules_of_bench():
    assert {"grading", "orchestration_overhead", "prox_logp"} <= set(bench.available())
    assert bench.available()["grading"].startswith("Grading throughput")


def test_bench_finds_a_new_module_and_runs_it_with_its_exit_status(tmp_path, monkeypatch, capsys):
    # A benchmark added later is found without being listed anywhere, run like `python -m`,
    # and its exit status comes back; a module without a __main__ block is not a benchmark.
    (tmp_path / "echo_args.py").write_text(textwrap.dedent('''\
        """Echo the arguments, exit with the first one."""
        import sys
        if __name__ == "__main__":
            print("ran", __name__, sys.argv[1:])
            sys.exit(int(sys.argv[1]))
        '''))
    (tmp_path / "helpers.py").write_text('"""Shared code, not a benchmark."""\n')
    monkeypatch.setattr(bench, "__path__", [*bench.__path__, str(tmp_path)])
    found = bench.available()
    assert found["echo_args"] == "Echo the arguments, exit with the first one." and "helpers" not in found
    assert main(["bench", "echo_args", "3", "--flag"]) == 3
    assert "ran __main__ ['3', '--flag']" in capsys.readouterr().out
    assert main(["bench", "helpers"]) == 2
    assert "unknown benchmark 'helpers'" in capsys.readouterr().err


def test_serve_without_the_scripts_fails_naming_where_it_looked(tmp_path):
    proc = _a3po("serve", env={"A3PO_ROOT": str(tmp_path)})
    assert proc.returncode == 2
    assert f"start_mlflow_postgres.sh not found (looked for {tmp_path}/infra/start_mlflow_postgres.sh)" in proc.stderr


def _stand_in(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\nset -eu\n" + body)
    path.chmod(0o755)


def test_serve_runs_both_scripts_with_the_ports_and_stops_the_rest_when_one_exits(tmp_path):
    infra, log = tmp_path / "infra", tmp_path / "log"
    infra.mkdir()
    _stand_in(infra / "start_mlflow_postgres.sh", f'''
if [ "${{1:-}}" = --stop ]; then echo "postgres stopped" >>{log}; exit 0; fi
echo "mlflow $A3PO_HOST:$A3PO_MLFLOW_PORT pid $$" >>{log}
exec sleep 120
''')
    _stand_in(infra / "start_prefect_server.sh", f'''
echo "prefect $A3PO_HOST:$A3PO_PREFECT_PORT" >>{log}
sleep 2
exit 3
''')
    proc = _a3po("serve", "--host", "127.0.0.2", "--mlflow-port", "5999", "--prefect-port", "4999", env={"A3PO_ROOT": str(tmp_path)}, timeout=60)
    assert proc.returncode == 3, proc.stderr  # the status of the server that stopped
    lines = log.read_text().splitlines()
    assert "prefect 127.0.0.2:4999" in lines and lines[-1] == "postgres stopped"
    mlflow_line = next(line for line in lines if line.startswith("mlflow "))
    assert mlflow_line.startswith("mlflow 127.0.0.2:5999 pid ")
    pid = int(mlflow_line.rsplit(" ", 1)[1])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()  # the other server was stopped


@pytest.mark.parametrize("command", ["compare", "nightly", "claims"])
def test_flow_options_out_of_bounds_exit_2_naming_the_option(command, tmp_path, capsys):
    # Checked by the flows' ComparisonSpec before any server starts or any folder is made.
    out = tmp_path / "out"
    assert main([command, "--preset", "micro", "--seeds", "", "--target-fraction", "1.5", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --seeds: List should have at least 1 item after validation, not 0",
                   "error: --target-fraction: Input should be less than or equal to 1, got 1.5"], err
    assert not out.exists()
