"""What one expert-parallel forward sends: `TransferStats`, recorded by both dispatchers."""

from __future__ import annotations

import dataclasses

__all__ = ["TransferStats", "METADATA_BYTES_PER_SLOT"]

#: Each slot travels with an int32 id (local id for all2all, physical id for allgather)
#: and a float32 weight.
METADATA_BYTES_PER_SLOT = 8


@dataclasses.dataclass
class TransferStats:
    """Bytes one rank sent to other ranks in one forward (dispatch + combine).

    Attributes
    ----------
    rows_sent : int
        Token rows sent to other ranks by the dispatch (allgather: padded rows x (E-1)).
    hidden_bytes : int
        Hidden-state bytes of those rows: rows_sent x H x element size (1 with FP8
        dispatch).
    metadata_bytes : int
        Slot ids and weights that travel with the rows: rows_sent x K' x
        `METADATA_BYTES_PER_SLOT`.
    count_bytes : int
        The row-count exchange that precedes the rows.
    combine_bytes : int
        Partial outputs sent back to their home ranks (0 until `combine` runs).
    scale_bytes : int
        FP8 dispatch: the float32 activation scales of those rows, rows_sent x groups x 4
        (0 for float rows).
    """

    rows_sent: int = 0
    hidden_bytes: int = 0
    metadata_bytes: int = 0
    count_bytes: int = 0
    combine_bytes: int = 0
    scale_bytes: int = 0

    @property
    def token_bytes(self) -> int:
        """The token rows as they travel: values plus (FP8) their scales."""
        return self.hidden_bytes + self.scale_bytes

    @property
    def dispatch_bytes(self) -> int:
        """Token rows, their scales and their metadata: what the dispatch itself moves."""
        return self.hidden_bytes + self.scale_bytes + self.metadata_bytes

    @property
    def total_bytes(self) -> int:
        """Every byte of the forward: dispatch, counts and combine."""
        return self.dispatch_bytes + self.count_bytes + self.combine_bytes

    def __add__(self, other: TransferStats) -> TransferStats:
        if not isinstance(other, TransferStats):
            return NotImplemented
        return TransferStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        """All fields plus ``token_bytes``, ``dispatch_bytes`` and ``total_bytes`` (for JSON)."""
        out = dataclasses.asdict(self)
        out["token_bytes"] = self.token_bytes
        out["dispatch_bytes"] = self.dispatch_bytes
        out["total_bytes"] = self.total_bytes
        return out
