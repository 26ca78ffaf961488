"""The code map (docs/internals/code-map.md) is the tree's (``python -m tests.code_map --write``
makes it): every module listed once under its wing, no module that is gone, each with its
docstring's line."""

from __future__ import annotations

from tests.code_map import FOLDERS, PAGE, REPO, code_map, on_page


def test_the_page_maps_every_module_of_the_tree_and_nothing_else() -> None:
    assert on_page(PAGE.read_text()) == code_map(), (
        "docs/internals/code-map.md differs from the tree: run `python -m tests.code_map --write`"
    )


def test_every_package_of_the_tree_has_a_place_in_the_map() -> None:
    packages = {
        str(init.parent.relative_to(REPO))
        for root in ("consumer", "topology")
        for init in (REPO / root).rglob("__init__.py")
    }

    assert packages == set(FOLDERS)
