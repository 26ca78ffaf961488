"""``python -m consumer``: the ``consumer`` command (:mod:`consumer.cli.main`)."""

from consumer.cli.main import main

raise SystemExit(main())
