"""Where the peer baselines' virtual environments live.

TRL 1.16 (``bench.peer_trl``, the ``bench`` extra) and TRL 1.12 (``bench.peer_trl_ppo`` and
``bench.oppo``'s TRL row, the ``bench-ppo`` extra: the last release with a PPOTrainer) cannot
share one environment, nor the project's ``.venv`` (``make test`` must not depend on TRL). Each
has a make target that builds it inside the checkout, as ``.venv-vllm`` is built:

    make setup-trl        # .venv-trl      (CPU torch, then -e '.[bench]')
    make setup-trl-ppo    # .venv-trl-ppo  (CPU torch, then -e '.[bench-ppo]')

An environment variable points a bench at one built elsewhere. Run from the project's own
``.venv`` (TRL not importable), a bench started as ``python -m bench.X`` re-runs itself under the
peer venv's interpreter when that venv exists, so both sides run in one process as documented.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PeerVenv:
    extra: str  # the pyproject extra installed into it
    folder: str  # default place, relative to the checkout
    env_var: str  # overrides the folder
    make_target: str

    def path(self) -> Path:
        return Path(os.environ.get(self.env_var) or REPO / self.folder)

    def python(self) -> Path:
        return self.path() / "bin" / "python"

    def install_hint(self, module: str) -> str:
        return (f"`make {self.make_target}` builds {self.folder} (CPU torch, then pip install -e '.[{self.extra}]'); "
                f"then `{self.folder}/bin/python -m {module}`, or `python -m {module}`, which finds it "
                f"(a venv elsewhere: {self.env_var}=DIR)")

    def rerun_here(self, module: str, argv: list[str]) -> None:
        """Replace this process with ``<venv>/bin/python -m module argv`` when the venv exists and
        this interpreter is not already its own; return otherwise (the caller then reports why TRL
        is missing). Only for a bench's ``__main__`` block: an in-process call must not exec."""
        python = self.python()
        if not python.exists() or Path(sys.prefix).resolve() == self.path().resolve():
            return
        print(f"{module}: running under {python} ({self.env_var} or the default {self.folder})", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        os.execve(python, [str(python), "-m", module, *argv], env)


TRL = PeerVenv(extra="bench", folder=".venv-trl", env_var="A3PO_TRL_VENV", make_target="setup-trl")
TRL_PPO = PeerVenv(extra="bench-ppo", folder=".venv-trl-ppo", env_var="A3PO_TRL_PPO_VENV", make_target="setup-trl-ppo")
