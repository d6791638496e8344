"""The argument rules every layer shares: what counts as an integer, and how a ``MOEROUTE_*``
environment variable is read.

One definition each, so that ``RouterConfig``, ``ExpertLayout``, the routing ops and the
vLLM-shaped entry points accept and refuse the same values (a NumPy integer is an integer
everywhere; a bool, a float or a string never is), and so that no environment variable
silently falls back to its default on a value nobody meant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "IntegerTypeError",
    "integer",
    "weights_then_ids",
    "ORDER_CHANGED",
    "environ_choice",
    "environ_int",
    "environ_directory",
]

#: Said by every refusal of a routing pair in the wrong order: before 0.2 some entry points
#: took (and returned) ids before weights.
ORDER_CHANGED = "weights come before ids since 0.2"


class IntegerTypeError(TypeError, ValueError):
    """An argument that must be an integer is of another kind (bool, float, str, ...).

    Both a TypeError (the kind of value is wrong) and a ValueError (what `RouterConfig`
    and the CLI catch for every bad argument), so either ``except`` sees it.
    """


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def integer(
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    error: type[Exception] = ValueError,
    type_error: type[Exception] = IntegerTypeError,
    why: str = "",
) -> int:
    """``value`` as a Python int within ``[minimum, maximum]`` (either bound optional).

    Accepted: Python ``int`` and NumPy integer scalars. Refused: ``bool`` (and
    ``numpy.bool_``), floats (even integral ones such as ``2.0``), strings, and anything
    else, with ``type_error`` (default `IntegerTypeError`, a TypeError and a ValueError);
    a value outside the bounds with ``error`` (default ValueError). Both messages name
    ``name``, the value and the allowed range, e.g. ``top_k=0 must be an integer >= 1``,
    and end with `` (why)`` when ``why`` is given (what the number counts, another allowed value).
    """
    what = f" ({why})" if why else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise type_error(
            f"{name}={value!r} must be an integer{_bounds(minimum, maximum)}{what}, got {type(value).__name__}"
        )
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise error(f"{name}={value} must be an integer{_bounds(minimum, maximum)}{what}")
    return value


def _dtype_name(array) -> str:
    """'float32', 'int64', 'bfloat16', ... for a NumPy, torch, CuPy or Numba array ("" without a dtype)."""
    dtype = getattr(array, "dtype", None)
    return "" if dtype is None else str(dtype).rsplit(".", 1)[-1]


def weights_then_ids(weights, ids, weights_name: str = "topk_weights", ids_name: str = "topk_ids") -> None:
    """TypeError unless ``weights`` has a floating dtype and ``ids`` an integer one.

    Every entry point that takes a (weights, ids) pair calls it first, so that a caller still
    passing the pair in the order before 0.2 (ids first) is refused by name instead of
    computing with ids read as weights. Arrays without a dtype (lists, scalars) are left to
    the entry point's own conversion.
    """
    weights_dtype, ids_dtype = _dtype_name(weights), _dtype_name(ids)
    if weights_dtype and not weights_dtype.startswith(("float", "bfloat")):
        raise TypeError(
            f"{weights_name} must be a floating array, got dtype {weights_dtype} ({ORDER_CHANGED}: "
            f"pass {weights_name}, {ids_name})"
        )
    if ids_dtype and not ids_dtype.startswith(("int", "uint")):
        raise TypeError(
            f"{ids_name} must be an integer array, got dtype {ids_dtype} ({ORDER_CHANGED}: "
            f"pass {weights_name}, {ids_name})"
        )


def environ_choice(variable: str, allowed: tuple[str, ...], default: str, why: str = "") -> str:
    """The value of environment variable ``variable``: one of ``allowed`` (case and
    surrounding blanks ignored), ``default`` when unset or empty.

    Raises
    ------
    ValueError
        Any other value, naming the variable, the value and the allowed ones.
    """
    raw = os.environ.get(variable)
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value not in allowed:
        what = f" ({why})" if why else ""
        raise ValueError(f"{variable}={raw!r} is not one of {allowed}{what}; unset it for the default {default!r}")
    return value


def environ_int(variable: str, default: int, minimum: int, why: str = "") -> int:
    """The value of environment variable ``variable`` as an integer >= ``minimum``,
    ``default`` when unset or empty; ValueError naming the variable otherwise."""
    raw = os.environ.get(variable)
    text = (raw or "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        what = f" ({why})" if why else ""
        raise ValueError(
            f"{variable}={raw!r} must be an integer >= {minimum}{what}; unset it for the default {default}"
        )
    return value


def environ_directory(variable: str, why: str = "") -> Path | str | None:
    """The value of environment variable ``variable`` naming a directory: None when unset
    or empty, the string ``"off"`` (any case), or the directory's Path (created later by
    its user when missing).

    Raises
    ------
    ValueError
        The value names something that exists and is not a directory.
    """
    raw = os.environ.get(variable)
    text = (raw or "").strip()
    if not text:
        return None
    if text.lower() == "off":
        return "off"
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        what = f" ({why})" if why else ""
        raise ValueError(
            f"{variable}={raw!r} is not a directory{what}; use a directory, 'off', or unset it for the default"
        )
    return path
