"""Description: the readable summary of an expert layout (`ExpertLayout.describe`).

Reads the layout through its public attributes and methods only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: describe() lists at most this many logical ids per rank.
_DESCRIBE_MAX_IDS = 16


def describe(layout: Any) -> str:
    """Readable summary of ``layout`` (a `moeroute.layout.ExpertLayout`); see its `describe`."""
    n, s, e = layout.num_routed_experts, layout.num_shared_experts, layout.ep_size
    p, r = layout.num_routed_physical, layout.num_redundant_experts
    slots_mode = layout.shared_slots
    lines = [
        f"ExpertLayout: {n} routed + {s} shared expert(s), {r} redundant, ep_size={e}, dispatch={layout.dispatch}",
    ]
    if slots_mode == "per_rank":
        composition = f"{p} routed + {e} x {s} per-rank shared slots"
    elif slots_mode == "global":
        composition = f"{p} routed + {s} global shared slots"
    else:
        composition = f"{p} routed, no shared slots"
    lines.append(f"physical experts: {layout.num_physical_experts} ({composition})")

    rows = [("rank", "physical ids", "local experts", "routed physical", "shared slot ids")]
    for rank in range(e):
        start, count = layout.routed_range(rank)
        slot_ids = layout.shared_slot_ids(rank)
        if slots_mode == "per_rank":
            block = start + rank * s  # b_r: the ranks before hold S slots each
            physical = f"[{block}, {block + count + s})"
            routed = f"[{start}, {start + count}) -> [{block}, {block + count})"
        else:
            physical = f"[{start}, {start + count})"
            if slots_mode == "global":
                physical += f" + [{p}, {p + s})"
            routed = f"[{start}, {start + count})"
        slots_text = _id_span(slot_ids) if slot_ids.size else "-"
        rows.append((str(rank), physical, str(layout.num_local_experts(rank)), routed, slots_text))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]

    if slots_mode == "per_rank":
        lines.append(
            f"shared slots: per_rank; each rank's block ends with its own {s} slot(s) "
            "and a token uses the slots of its home rank"
        )
    elif slots_mode == "global":
        masked = " (computed only on the token's home rank)" if layout.home_rank_masked else ""
        local = "local id L_r" if s == 1 else f"local ids L_r..L_r+{s - 1}"
        lines.append(
            f"shared slots: global ids {_id_span(layout.shared_slot_ids(0))}, held by every rank as {local}{masked}"
        )
    else:
        lines.append("shared slots: none (the shared expert is not fused)")
    lines.append(f"shared expert: {layout.shared}. {layout.shared_reason}")
    placement, table = layout.placement, layout.physical_to_logical
    if placement == "linear":
        if r:
            replicas = ", ".join(f"{n + i}->{int(table[n + i])}" for i in range(min(r, 16)))
            more = f", ... ({r - 16} more)" if r > 16 else ""
            lines.append(f"replicas (physical->logical): {replicas}{more}")
    else:
        how = (
            "round_robin: rank r holds entries r, r+E, r+2E, ... of the linear sequence"
            if placement == "round_robin"
            else "physical_to_logical table"
        )
        lines.append(f"placement: {how}; logical experts of each rank, in local id order:")
        for rank in range(e):
            logical = layout.logical_experts(rank).tolist()
            shown = ", ".join(str(x) for x in logical[:_DESCRIBE_MAX_IDS])
            more = f", ... ({len(logical) - _DESCRIBE_MAX_IDS} more)" if len(logical) > _DESCRIBE_MAX_IDS else ""
            lines.append(f"  rank {rank}: {shown}{more}")
    lines.append(f"scaling regime: {layout.scaling_regime}")
    problems = layout.check_backend("equal_blocks")
    lines.append(
        "equal-block backends (DeepEP/MoRI-style): "
        + ("compatible" if not problems else "incompatible: " + "; ".join(problems))
    )
    return "\n".join(lines)


def _id_span(ids: np.ndarray) -> str:
    """'9' for one id, '9..12' for a contiguous run."""
    first, last = int(ids[0]), int(ids[-1])
    return str(first) if first == last else f"{first}..{last}"
