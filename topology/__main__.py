"""``python -m topology apply [--dry-run]`` and ``python -m topology check``: the same as
``consumer topology``."""

from topology.cli import main

raise SystemExit(main())
