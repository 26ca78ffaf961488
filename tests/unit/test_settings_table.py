"""docs/operations/settings.md's table is the settings' own (``python -m tests.settings_table
--write`` makes it from consumer/config/settings.py): every setting, its default, its docstring."""

from __future__ import annotations

from consumer.config.settings import Settings
from tests.settings_table import PAGE, docstrings, on_page, table


def test_every_setting_has_a_docstring_to_document_it() -> None:
    missing = set(Settings.model_fields) - set(docstrings())

    assert not missing, f"settings without a docstring under them: {sorted(missing)}"


def test_the_page_shows_the_settings_as_defined() -> None:
    assert on_page(PAGE.read_text()) == table(), (
        "docs/operations/settings.md differs from consumer/config/settings.py: "
        "run `python -m tests.settings_table --write`"
    )
