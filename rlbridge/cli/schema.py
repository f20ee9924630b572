"""`rlbridge schema`: the recipe's JSON Schema (for editor completion and inline validation)."""

from __future__ import annotations

import json

from rlbridge.cli.common import example
from rlbridge.recipe.schema import Recipe


@example("rlbridge schema > recipe.schema.json")
def schema() -> None:
    """Print the JSON Schema of the recipe."""
    print(json.dumps(Recipe.model_json_schema(), indent=2))
