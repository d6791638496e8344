"""What the rooms of the layout share: its error, the id dtype and the argument checks."""

from __future__ import annotations

from typing import Any

import numpy as np

from moeroute._validate import integer

ID_DTYPE = np.int32
#: Largest physical expert count: ids are int32 (-1 marks "not held"), so every id in
#: [0, count) must fit in int32.
MAX_PHYSICAL_EXPERTS = int(np.iinfo(ID_DTYPE).max)


class LayoutError(ValueError):
    """An expert layout that cannot work; the message says why and what to use instead."""


def readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (`moeroute._validate.integer`), LayoutError
    naming ``name`` otherwise."""
    return integer(name, value, minimum, error=LayoutError, type_error=LayoutError)


def choice(name: str, value: Any, allowed: tuple, extra: str = "") -> None:
    if not isinstance(value, str) or value not in allowed:
        allowed_text = ", ".join(repr(a) for a in allowed)
        raise LayoutError(f"unknown {name}={value!r}; use one of {allowed_text}{extra}")
