"""`python -m equiconvert`: the command line (see equiconvert.cli)."""

from .cli import main

raise SystemExit(main())
