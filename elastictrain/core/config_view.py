"""A read-only view of a Config: what ``session.config`` returns.

The session decided everything from its config at SETUP; a value changed afterwards would be read by some parts and
not by others. So reads pass through (``session.config.train.batch_size``) and a write is one UsageError naming the key.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from pydantic import BaseModel

from elastictrain.core.errors import UsageError


class ConfigView:
    """Read ``session.config.<section>.<key>`` as on a ``Config``; setting one raises UsageError."""

    __slots__ = ("_target", "_path")

    def __init__(self, target: BaseModel, path: str = "") -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if isinstance(value, BaseModel):
            return ConfigView(value, f"{self._path}{name}.")
        if isinstance(value, dict):
            return MappingProxyType(value)
        if isinstance(value, list):
            return tuple(value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise UsageError(
            f"session.config.{self._path}{name} is read-only: the session read its config at SETUP; set "
            f"{self._path}{name} in the config or as an override ({self._path}{name}=...) instead"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        return f"ConfigView({self._target!r})"

    def __eq__(self, other: object) -> bool:
        return self._target == (other._target if isinstance(other, ConfigView) else other)

    __hash__ = None  # type: ignore[assignment]
