"""``python -m bench.gate``: :mod:`bench.gate.gate`."""

import sys

from bench.gate.gate import main

sys.exit(main())
