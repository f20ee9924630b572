"""What every recipe section shares: the `Section` base (unknown keys are errors, values frozen, floats finite,
integers bounded) and the integer type most keys use."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

PositiveInt = Annotated[int, Field(ge=1)]
MAX_INT = 2**31 - 1
"""The largest integer a recipe takes (any key): counts past it overflow the int32 indices and seeds of torch,
numpy and vLLM somewhere in a run, and a number that large is a typo (`steps: 100000000000000000000000`)."""


def enum_key(default: StrEnum, title: str) -> Any:
    """The field of a key whose values are a `str` enum's (e.g. rollout.weight_sync): its JSON Schema lists the
    values in place, as a `Literal` key's does, instead of a `$ref` to a definition, so that `rlbridge schema`
    reads like every other choice and an editor shows the values on hover. `title` is the one pydantic gives
    other keys (the name, words capitalized)."""
    values = [member.value for member in type(default)]

    def in_place(schema: dict[str, Any]) -> None:
        schema.pop("$ref", None)
        schema.update(enum=values, type="string")

    return Field(default, title=title, json_schema_extra=in_place)


class Section(BaseModel):
    """Every recipe section: unknown keys are errors, values are frozen, floats are finite (`.inf` and `.nan`
    are refused: an infinite learning rate trains NaNs), integers lie within +-MAX_INT."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_ints(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise PydanticCustomError(
                "int_too_large",
                "{value} is out of range: a recipe's integers lie within +-{max} (int32)",
                {"value": value, "max": MAX_INT},
            )
        return value
