"""``python -m consumer``: the ``consumer`` command (:mod:`consumer.cli`)."""

from consumer.cli import main

raise SystemExit(main())
