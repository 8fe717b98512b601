"""Task args: ``--task-arg KEY=VALUE`` strings and the plain values a run's config holds, converted
by the task callable's declared parameter types (never imported or evaluated)."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, Mapping


class TaskError(ValueError):
    """A task that cannot be loaded, built or used (one clear line; ``common.task`` re-exports it)."""


def _fmt_args(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def parse_task_args(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings to a dict of strings; ``load_task`` converts each to the type the task
    callable declares for it (its default's type or its annotation): ``path=2024`` stays a string
    for ``path: str``, ``n_layer=2`` becomes 2 for ``n_layer: int = 6``. A dotted KEY
    (``config.num_hidden_layers=4``) goes as it is to a callable that takes ``**kwargs``, which
    converts it (the ``hf`` task: by the type of the model config's attribute it overrides)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise TaskError(f"--task-arg wants KEY=VALUE with KEY an identifier (or dotted identifiers, "
                            f"config.NAME), got {item!r}")
        out[key] = raw.strip()
    return out


def parse_value(raw: str, kind: str | None = None) -> Any:
    """A command-line value as ``kind`` ("int", "float", "bool", "str"); without a kind: true/false,
    an int, a float, else the string itself. ValueError when it is not a ``kind``."""
    if kind == "str":
        return raw
    if kind == "bool" or (kind is None and raw.lower() in ("true", "false")):
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    if kind == "int":
        return int(raw)
    if kind == "float":
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    for cast in (int, float):
        try:
            value = cast(raw)
        except ValueError:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return raw  # "nan", "inf": a string unless the callable declares a float
        return value
    return raw


def _declared_kind(param: inspect.Parameter) -> str | None:
    """int, float, bool or str: the parameter's annotation, else its default's type."""
    note = param.annotation
    name = note if isinstance(note, str) else getattr(note, "__name__", None)
    if name in ("int", "float", "bool", "str"):
        return name
    default = param.default
    if default is not inspect.Parameter.empty and default is not None and type(default).__name__ in (
            "int", "float", "bool", "str"):
        return type(default).__name__
    return None


def _coerce_args(fn: Callable[..., Any], args: Mapping[str, Any], target: str) -> dict[str, Any]:
    """``args`` checked against ``fn``'s signature; string values converted to the declared type."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    params = dict(sig.parameters) if sig is not None else {}
    open_kwargs = sig is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
    known = {n: p for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    unknown = sorted(set(args) - set(known))
    dotted = sorted(k for k in unknown if "." in k)
    if dotted and not open_kwargs:
        raise TaskError(f"{target} takes no dotted task arg(s) {', '.join(dotted)}: only a task callable with "
                        f"**kwargs does (the hf task's config.NAME)")
    if unknown and not open_kwargs:
        raise TaskError(f"{target} takes no task arg(s) {', '.join(unknown)}; it accepts: "
                        f"{', '.join(sorted(known)) or 'none'}")
    out: dict[str, Any] = {}
    for key, value in args.items():
        kind = _declared_kind(known[key]) if key in known else None
        if isinstance(value, str) and "." in key:
            pass   # a dotted key's string: the task converts it by what it overrides
        elif isinstance(value, str):
            try:
                value = parse_value(value, kind)
            except ValueError as e:
                raise TaskError(f"task arg {key}={value!r}: {e} ({target} declares {kind})") from None
        elif isinstance(value, float) and not math.isfinite(value):
            raise TaskError(f"task arg {key}={value!r}: expected a finite number")
        out[key] = value
    return out


