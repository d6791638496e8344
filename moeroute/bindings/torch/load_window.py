"""Load windows: tokens per physical expert over the last forwards of one MoE layer (torch).

``MoE(..., record_load=True, load_window=W)`` owns a `LoadRecorder`. Each forward counts,
on the device of the forward and without a host synchronization, the (token, routed slot)
pairs of the tokens of THIS rank (their home rank) per routed physical expert, into row
``forward % W`` of an int64 ring [W, num_physical_experts]; the row is zeroed first, so the
ring always holds the last W forwards. Every pair is counted once in the whole EP group
(at home, before the dispatch), so summing the ranks' windows gives the group's load.

Counters refer to the placement they were measured under: swapping a layer's placement
(`moeroute.eplb.apply`) clears its window.
"""

from __future__ import annotations


import torch

from moeroute._validate import integer
from moeroute.routing.load import expert_load

__all__ = ["LoadRecorder", "DEFAULT_LOAD_WINDOW"]

#: Forwards a window covers by default: long enough to smooth batch-to-batch noise, small
#: enough (128 x P int64: 300 KB for DeepSeek-V3's 288 physical experts) for every layer.
DEFAULT_LOAD_WINDOW = 128


def check_window(load_window) -> int:
    return integer("load_window", load_window, 1, why="forwards per window")


class LoadRecorder:
    """Ring of per-forward token counts per physical expert of one layer.

    Parameters
    ----------
    window : int
        W >= 1, the number of forwards kept.

    Attributes
    ----------
    counts : Tensor int64 [W, num_physical_experts] or None
        Allocated at the first forward, on its device (moved with the forward's device).
    forwards : int
        Forwards recorded since the last `reset` (at most W of them are in ``counts``).
    """

    def __init__(self, window: int = DEFAULT_LOAD_WINDOW) -> None:
        self.window = check_window(window)
        self.counts: torch.Tensor | None = None
        self.forwards = 0

    def record(self, physical_ids: torch.Tensor, num_physical_experts: int) -> None:
        """Add one forward: ``physical_ids`` [T, K'] int32 (``append_shared_slots`` output)."""
        counts = self.counts
        if counts is None or counts.device != physical_ids.device or counts.shape[1] != num_physical_experts:
            counts = torch.zeros(self.window, num_physical_experts, dtype=torch.int64, device=physical_ids.device)
            self.counts, self.forwards = counts, 0
        row = counts[self.forwards % self.window]
        row.zero_()
        expert_load(physical_ids, num_physical_experts, out=row)
        self.forwards += 1

    def reset(self) -> None:
        """Forget every recorded forward (the counters stay allocated)."""
        if self.counts is not None:
            self.counts.zero_()
        self.forwards = 0

    def physical_load(self, layout) -> torch.Tensor:
        """int64 [P]: tokens per ROUTED physical expert over the window (shared slots left
        out), on the counters' device; zeros before the first forward."""
        p = layout.num_routed_physical
        if self.counts is None:
            return torch.zeros(p, dtype=torch.int64)
        total = self.counts.sum(dim=0)
        routed = torch.tensor(layout.routed_id_map.tolist(), dtype=torch.int64, device=total.device)
        return total.index_select(0, routed)
