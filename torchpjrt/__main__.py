"""`python -m torchpjrt bench ...` runs the command-line interface (torchpjrt.cli)."""

from .cli import main

raise SystemExit(main())
