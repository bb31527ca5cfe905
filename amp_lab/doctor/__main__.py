"""`python -m amp_lab.doctor`: see amp_lab.doctor.cli."""

import sys

from amp_lab.doctor.cli import main

sys.exit(main())
