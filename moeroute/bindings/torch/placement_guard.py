"""`PlacementGuard`: an MoE layer's forwards share its expert placement; a swap is exclusive.

An EPLB swap (`moeroute.eplb.apply`) writes the new experts' rows in place and assigns a
new layout. A forward reads the layout (routing to physical ids) and then the expert rows;
were a swap to land between the two, the forward would compute its old ids against the new
rows. So a forward holds the guard shared from routing to its output, and the swap holds it
exclusively: it waits for the forwards in flight and new forwards wait for it (a waiting
swap goes first, so a stream of forwards cannot starve it).

The guard holds no state worth keeping: a pickled or copied layer gets a fresh one.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["PlacementGuard"]


class PlacementGuard:
    """A reader-writer lock: `forward` is shared, `swap` exclusive and preferred.

    Neither is reentrant: a thread holding `forward` must not enter `swap` on the same
    guard (an MoE forward asks for its pending swap before it takes the guard).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._forwards = 0
        self._swapping = False
        self._swaps_waiting = 0
        self._forward = _Forward(self)  # stateless: one context manager serves every forward

    def forward(self) -> "_Forward":
        """Held by a forward from its routing to its output (shared): ``with guard.forward():``."""
        return self._forward

    def _enter_forward(self) -> None:
        with self._condition:
            while self._swapping or self._swaps_waiting:
                self._condition.wait()
            self._forwards += 1

    def _exit_forward(self) -> None:
        with self._condition:
            self._forwards -= 1
            if not self._forwards and self._swaps_waiting:
                self._condition.notify_all()

    @contextlib.contextmanager
    def swap(self):
        """Held while a new placement is written (exclusive): waits for the forwards in flight."""
        with self._condition:
            self._swaps_waiting += 1
            try:
                while self._swapping or self._forwards:
                    self._condition.wait()
            finally:
                self._swaps_waiting -= 1
                self._condition.notify_all()  # forwards held back by this waiting swap re-check
            self._swapping = True
        try:
            yield
        finally:
            with self._condition:
                self._swapping = False
                self._condition.notify_all()

    @property
    def swap_waiting(self) -> bool:
        """A swap waits for forwards in flight (introspection, and for tests)."""
        with self._condition:
            return self._swaps_waiting > 0

    @property
    def forwards_in_flight(self) -> int:
        with self._condition:
            return self._forwards

    # Locks neither pickle nor copy; a copied layer has no forward in flight.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __deepcopy__(self, memo) -> "PlacementGuard":
        return PlacementGuard()


class _Forward:
    """`PlacementGuard.forward`'s context manager (a class, not a generator: the forward path
    pays two lock round trips and nothing else)."""

    __slots__ = ("_guard",)

    def __init__(self, guard: PlacementGuard) -> None:
        self._guard = guard

    def __enter__(self) -> None:
        self._guard._enter_forward()

    def __exit__(self, *exc_info) -> None:
        self._guard._exit_forward()
