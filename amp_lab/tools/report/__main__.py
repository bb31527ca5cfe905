"""`python -m amp_lab report`: see amp_lab.tools.report.compare."""

import sys

from amp_lab.tools.report.compare import main

sys.exit(main())
