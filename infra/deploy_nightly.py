"""Register the nightly convergence-parity deployment (cron ``0 2 * * *``, UTC): an alias of
``python infra/deploy.py nightly-parity``, which registers any deployment of ``infra/prefect.yaml``.

    export PREFECT_API_URL=http://127.0.0.1:4200/api     # infra/start_prefect_server.sh
    python infra/deploy_nightly.py                        # deploy to work pool a3po-local (infra/start_worker.sh runs it)
    python infra/deploy_nightly.py --serve                # or: serve it from this process (no worker needed)
    python infra/deploy_nightly.py --run-now --param preset=micro --param 'seeds=[0]'   # plus one run now

Ends with one JSON line (deployment, id, pool, cron, parameters, flow run id).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deploy import main  # noqa: E402  (infra/ is not a package)

if __name__ == "__main__":
    sys.exit(main(deployment="nightly-parity", prog="python infra/deploy_nightly.py"))
