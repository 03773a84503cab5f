"""`python -m myria` runs the CLI."""

from myria.cli import main

raise SystemExit(main())
