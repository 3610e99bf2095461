"""``python -m bench``: list the benchmarks; ``python -m bench NAME ...`` runs one."""

import sys

from bench import main

sys.exit(main())
