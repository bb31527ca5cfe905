"""`python -m amp_lab doctor`: see amp_lab.tools.doctor.cli."""

import sys

from amp_lab.tools.doctor.cli import main

sys.exit(main())
