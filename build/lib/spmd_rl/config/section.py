"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
