"""``python -m cli ...``: the ``a3po`` command line."""

import sys

from cli.dispatch import main

sys.exit(main())
