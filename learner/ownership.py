"""Check mode for the rule "every mutable attribute has one owning thread" (docs/STYLE.md).

A learner's mutable state lives in objects each owned by one thread (its training, network or
control thread; see each module's docstring); other threads read frozen values the owner
publishes. With ``CHECKS`` on (tests turn it on before a learner is built), each such object is
wrapped in ``Owned``: once its owner ``claim``s it, any attribute read or write from another
thread raises ``ForeignThreadAccess`` naming the object, the attribute and both threads. Off (the
default), ``owned`` returns the object itself: nothing is checked and nothing costs.
"""
from __future__ import annotations

import threading
from typing import Any, TypeVar

CHECKS = False
"""Wrap owned objects in ``Owned`` (set before the learner is built)."""

T = TypeVar("T")


class ForeignThreadAccess(RuntimeError):
    """An owned object was touched from a thread that does not own it."""


class Owned:
    """A proxy of ``target`` that only its owner thread may use (before ``claim``: any thread)."""

    __slots__ = ("_target", "_name", "_owner")

    def __init__(self, target: Any, name: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_owner", None)

    def _check(self, attr: str) -> None:
        owner = object.__getattribute__(self, "_owner")
        if owner is not None and owner is not threading.current_thread():
            raise ForeignThreadAccess(f"{object.__getattribute__(self, '_name')}.{attr} used from thread "
                                      f"{threading.current_thread().name!r}; it belongs to {owner.name!r}")

    def __getattr__(self, attr: str) -> Any:
        self._check(attr)
        return getattr(object.__getattribute__(self, "_target"), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        self._check(attr)
        setattr(object.__getattribute__(self, "_target"), attr, value)


def owned(target: T, name: str) -> T:
    """``target`` itself, or with ``CHECKS`` on, wrapped in ``Owned``."""
    return Owned(target, name) if CHECKS else target  # type: ignore[return-value]


def claim(*objs: Any) -> None:
    """The calling thread owns ``objs`` from now on (no-op for objects that are not ``Owned``)."""
    for obj in objs:
        if isinstance(obj, Owned):
            object.__setattr__(obj, "_owner", threading.current_thread())


def unwrapped(obj: T) -> T:
    """The object an ``Owned`` wraps (for the owner's own use, e.g. to copy it), else ``obj``."""
    return object.__getattribute__(obj, "_target") if isinstance(obj, Owned) else obj
