"""The base of every manifest section: unknown keys forbidden, attribute docstrings become descriptions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every manifest section: unknown keys forbidden, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)
