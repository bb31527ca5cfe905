"""`python -m amp_lab.report`: see amp_lab.report.compare."""

import sys

from amp_lab.report.compare import main

sys.exit(main())
