"""Prefect flows of the pipeline.

- ``flows.compare_variants``  prepare -> warm start -> train each variant x seed -> evaluate ->
                              comparison table, speedups, plots (``python -m flows.compare_variants``)
- ``flows.nightly_parity``    the comparison over K seeds + a paired-bootstrap parity decision,
                              trend against earlier nights, non-zero exit on failure
- ``flows.paper_claims``      the comparison of the three variants + one verdict per claim of
                              the A-3PO paper (reproduced / not reproduced / not measurable here)
- ``flows.train_one``         one variant x seed (train, evaluate, log under the parent run):
                              the deployment a comparison fans out to over workers

``flows.common`` holds the skeleton the first three share (their parameters as one
``ComparisonSpec``, the parent MLflow run, the comparison itself) and ``flows.cli`` their
command line.

Prefect reads its settings at import, so the offline defaults (telemetry off, project-local
``PREFECT_HOME``) are applied here, before any flow module imports Prefect; unset variables
only, so team mode and tests keep control (see ``tasks.runtime``).
"""

from tasks.runtime import apply_local_defaults

apply_local_defaults()
