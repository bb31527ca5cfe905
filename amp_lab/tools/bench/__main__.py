"""`python -m amp_lab bench`: see amp_lab.tools.bench.cli."""

from amp_lab.tools.bench.cli import main

raise SystemExit(main())
