"""The expert-parallel group as the torch module sees it: its size and this process's rank,
and the check that every rank built the same layer (one ``all_gather_object`` of plain
fields, at construction). The dispatchers that move tokens between the ranks build on these
(`moeroute.bindings.ep`, registered with `moeroute.bindings.torch.dispatch`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist

from moeroute.layout import ExpertLayout

__all__ = [
    "CollectiveError",
    "RankMismatchError",
    "ep_group_size_and_rank",
    "layout_fingerprint",
    "check_ranks_agree",
    "fields_digest",
]

#: Bytes of the layout digest kept in the signature: 7 bytes fit a non-negative int64.
_DIGEST_BYTES = 7
#: Longest rendering of one rank's value in a `RankMismatchError` (long tables are cut).
_MAX_VALUE_CHARS = 120


class CollectiveError(RuntimeError):
    """A collective of the dispatch failed: a peer died or missed the group's timeout."""


class RankMismatchError(ValueError):
    """The ranks of one expert-parallel group disagree on a field of the layer.

    Raised on every rank with the same message: each differing field with every rank's
    value. ``fields`` maps each differing field name to the list of per-rank values.
    """

    def __init__(self, message: str, fields: dict[str, list]) -> None:
        super().__init__(message)
        self.fields = fields


def _render(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def ep_group_size_and_rank(ep_group: Any) -> tuple[int, int]:
    """(size, rank) of ``ep_group`` in torch.distributed.

    Raises
    ------
    TypeError
        ``ep_group`` is not a torch.distributed ProcessGroup (e.g. the string "world";
        pass ``torch.distributed.group.WORLD`` or a group from ``new_group``).
    ValueError
        torch.distributed is not initialized.
    """
    if not dist.is_available() or not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(
            f"ep_group={ep_group!r} must be a torch.distributed ProcessGroup (e.g. "
            f"torch.distributed.group.WORLD or torch.distributed.new_group(...)) or None, "
            f"got {type(ep_group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            "ep_group needs an initialized torch.distributed process group; call "
            "torch.distributed.init_process_group first"
        )
    return dist.get_world_size(ep_group), dist.get_rank(ep_group)


def layout_fingerprint(layout: ExpertLayout) -> dict[str, Any]:
    """The fields of ``layout`` every rank of its group must agree on, as plain values."""
    return {
        "layout.num_routed_experts": layout.num_routed_experts,
        "layout.num_shared_experts": layout.num_shared_experts,
        "layout.ep_size": layout.ep_size,
        "layout.dispatch": layout.dispatch,
        "layout.shared": layout.shared,
        "layout.shared_slots": layout.shared_slots,
        "layout.num_redundant_experts": layout.num_redundant_experts,
        "layout.scaling_regime": layout.scaling_regime,
        "layout.placement": getattr(layout, "placement", "linear"),
        "layout.physical_to_logical": tuple(int(v) for v in layout.physical_to_logical),
    }


def fields_digest(fields: dict[str, Any]) -> int:
    """A process-independent integer digest (Python's hash() is salted per process)."""
    text = repr(sorted(fields.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=_DIGEST_BYTES).digest(), "little")


def check_ranks_agree(fields: dict[str, Any], group: Any = None, what: str = "the layer") -> None:
    """Exchange ``fields`` between the ranks of ``group`` and raise unless all agree.

    A collective: every rank of ``group`` must call it (with the same field names). It
    uses ``torch.distributed.all_gather_object``; with NCCL the current CUDA device must
    be this rank's.

    Parameters
    ----------
    fields : dict
        Field name -> a picklable value comparable with ``==`` (ints, strings, tuples).
    group : torch.distributed.ProcessGroup, optional
        None: the default group.
    what : str
        What the fields describe, for the message.

    Raises
    ------
    RankMismatchError
        On every rank, with the same message: each field whose values differ, with every
        rank's value.
    CollectiveError
        A peer exited or did not join the exchange within the group's timeout.
    """
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    try:
        dist.all_gather_object(gathered, dict(fields), group=group)
    except RuntimeError as error:
        raise CollectiveError(
            f"rank {dist.get_rank(group)} of {world}: the agreement check of {what} failed; a "
            f"peer rank exited (perhaps failing to build its layer) or did not reach the check "
            f"within the process group's timeout ({error})"
        ) from error
    names = list(dict.fromkeys(name for rank_fields in gathered for name in rank_fields))
    missing = "<missing>"
    differing = {}
    for name in names:
        values = [rank_fields.get(name, missing) for rank_fields in gathered]
        if any(value != values[0] for value in values[1:]):
            differing[name] = values
    if differing:
        details = "; ".join(
            f"{name}: " + ", ".join(f"rank {r}={_render(v)}" for r, v in enumerate(values))
            for name, values in differing.items()
        )
        raise RankMismatchError(
            f"the {len(gathered)} expert-parallel ranks disagree on {what}: {details}; "
            "build every rank's layer with the same arguments",
            differing,
        )
