"""`python -m amp_lab.bench`: see amp_lab.bench.cli."""

from amp_lab.bench.cli import main

raise SystemExit(main())
