"""``python -m consumer``: see :mod:`consumer.cli`."""

from consumer.cli import main

raise SystemExit(main())
