"""``consumer publish``'s check of a payload against its handler's model: a model that raises
something else than a validation error is a refusal on one line, not a traceback (the service
takes such a payload for poison, ``invalid_payload``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter, field_validator

from consumer.registry import Handler, HandlerRegistry, payload_problem


class Strict(BaseModel):
    code: str

    @field_validator("code")
    @classmethod
    def _known(cls, value: str) -> str:
        # A validator's own bug: pydantic turns only ValueError and AssertionError into a
        # ValidationError, the rest goes through
        return {"a": "alpha"}[value]


async def _apply(event: Any, conn: Any) -> None:
    return None


def _registry() -> HandlerRegistry:
    return HandlerRegistry(
        [Handler(event_type="check.strict", func=_apply, payload=TypeAdapter(Strict))]
    )


def test_a_payload_its_model_takes_has_no_problem() -> None:
    assert payload_problem(_registry(), "check.strict", {"code": "a"}) is None


def test_a_model_raising_outside_validation_is_a_refusal_on_one_line() -> None:
    problem = payload_problem(_registry(), "check.strict", {"code": "zz"})

    assert problem is not None
    assert problem.startswith("check.strict payload refused by its schema")
    assert "KeyError" in problem
    assert "\n" not in problem
