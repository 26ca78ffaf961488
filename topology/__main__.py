"""``python -m topology apply [--dry-run]`` and ``python -m topology check``."""

from topology.cli import main

raise SystemExit(main())
