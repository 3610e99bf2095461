"""Prefect flows of the pipeline.

- ``flows.compare_variants``  prepare -> warm start -> train each variant x seed -> evaluate ->
                              comparison table, speedups, plots (``python -m flows.compare_variants``)
- ``flows.nightly_parity``    the comparison over K seeds + a paired-bootstrap parity decision,
                              trend against earlier nights, non-zero exit on failure

Prefect reads its settings at import, so the offline defaults (telemetry off, project-local
``PREFECT_HOME``) are applied here, before any flow module imports Prefect; unset variables
only, so team mode and tests keep control (see ``tasks.runtime``).
"""

from tasks.runtime import apply_local_defaults

apply_local_defaults()
