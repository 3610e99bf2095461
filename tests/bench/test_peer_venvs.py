"""bench._peer_venvs: a peer bench started from another interpreter re-runs itself under the peer
venv's python (the same module and arguments, the checkout importable); without that venv it
returns, and the caller says which make target builds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RERUN = """
from bench._peer_venvs import PeerVenv
PeerVenv(extra="bench", folder=".venv-none", env_var="A3PO_TEST_PEER_VENV", make_target="setup-x").rerun_here("bench.peer_trl", ["--cycles", "3"])
print("returned")
"""


def _run(env_venv: Path) -> subprocess.CompletedProcess:
    # No PYTHONPATH from here: ``-c`` in the checkout imports bench, and whatever path the re-run
    # gets is what rerun_here gave it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"A3PO_TEST_PEER_VENV": str(env_venv)}
    return subprocess.run([sys.executable, "-c", RERUN], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.name != "posix", reason="the fake interpreter is a shell script")
def test_an_existing_peer_venv_runs_the_same_module_and_arguments_with_the_checkout_importable(tmp_path):
    venv = tmp_path / "peer"
    (venv / "bin").mkdir(parents=True)
    record = tmp_path / "argv.txt"
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\necho "$PYTHONPATH" >> {record}\n')
    fake.chmod(0o755)
    done = _run(venv)
    assert done.returncode == 0, done.stderr
    assert "returned" not in done.stdout  # the process was replaced, not continued
    args, pythonpath = record.read_text().splitlines()
    assert args == "-m bench.peer_trl --cycles 3"
    assert str(REPO) in pythonpath.split(os.pathsep)  # bench/ is not installed: the checkout must be on the path
    assert "setup-x" in done.stderr or "A3PO_TEST_PEER_VENV" in done.stderr


def test_without_the_peer_venv_it_returns_and_the_bench_names_the_make_target(tmp_path):
    done = _run(tmp_path / "absent")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned"



def test_each_peer_venv_has_the_make_target_its_hint_names_and_is_git_ignored():
    from bench._peer_venvs import TRL, TRL_PPO

    makefile = (REPO / "Makefile").read_text()
    ignored = (REPO / ".gitignore").read_text().split()
    for venv in (TRL, TRL_PPO):
        assert f"`make {venv.make_target}`" in venv.install_hint("bench.x")
        assert f"\n{venv.make_target}: " in makefile, venv.make_target
        assert f"?= {venv.folder}\n" in makefile, venv.folder  # the target builds the folder the bench looks in
        assert f"/{venv.folder}/" in ignored
