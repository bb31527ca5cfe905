"""`python -m amp_lab.doctor`: see amp_lab.doctor.diagnose."""

import sys

from amp_lab.doctor.diagnose import main

sys.exit(main())
