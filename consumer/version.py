"""The release, in one place: a release bumps this constant (and CHANGELOG.md), nothing else.

pyproject.toml reads it for the package's metadata, ``consumer --version`` prints it and
``consumer_build_info{version}`` exports it, so all three always agree.
"""

__version__ = "0.2.0"
