"""The ``consumer`` command and its subcommands."""
