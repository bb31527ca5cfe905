"""`python -m amp_lab.bench`: see amp_lab.bench.cli."""

import sys

from amp_lab.bench.cli import main

sys.exit(main())
