"""Placements, the balancedness metric and the rebalancer (NumPy + Numba, no torch).

Vocabulary: L layers, N logical experts, P physical (routed) experts, E expert-parallel
ranks; rank r holds physical ids [r*P/E, (r+1)*P/E). A placement's
``physical_to_logical[l, p]`` is the logical expert physical expert p computes in layer l:
exactly the ``physical_to_logical`` table `moeroute.ExpertLayout` takes.

Replica split rule. moeroute sends token row t of logical expert e to replica
``replicas[((t * 2654435769) mod 2**32) % count]`` (`moeroute.ExpertLayout.choose_replica`),
which spreads the rows of a batch evenly over the replicas. The planning metrics therefore
split a logical expert's load evenly over its replicas: each of its c replicas carries
``load / c``. Measured counters (`rank_load_from_physical`) need no rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeroute._validate import integer
from moeroute.eplb import _policy

__all__ = [
    "Placement",
    "rebalance",
    "balancedness",
    "rank_load",
    "rank_load_from_physical",
    "balancedness_from_physical",
    "fold_physical_load",
    "linear_placement",
    "round_robin_placement",
    "POLICIES",
]

#: "hierarchical": expert groups onto nodes, replicas inside nodes, then onto the node's
#: ranks (used when num_groups % num_nodes == 0); "global": one pool of ranks.
POLICIES = ("hierarchical", "global")

_ID_DTYPE = np.int32


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _check_load(load: Any, name: str = "load") -> tuple[np.ndarray, bool]:
    """``load`` as float64 [L, N] and whether it was 1-D; ValueError naming what is wrong."""
    if hasattr(load, "detach"):  # a torch tensor: counters may live on a device
        load = load.detach().cpu().numpy()
    try:
        array = np.asarray(load)
    except Exception as error:  # ragged lists and the like
        raise ValueError(f"{name} must be a numeric array [N] or [L, N]: {error}") from None
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"{name} must hold numbers (tokens per expert), got dtype {array.dtype}")
    if array.ndim not in (1, 2):
        raise ValueError(f"{name} has shape {array.shape}; use [N] (one layer) or [L, N]")
    if array.shape[-1] < 1 or (array.ndim == 2 and array.shape[0] < 1):
        raise ValueError(f"{name} has shape {array.shape}; it needs at least one layer and one expert")
    values = array.astype(np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(index)}={values[index]} is not finite; loads must be finite numbers >= 0")
    if (values < 0).any():
        index = tuple(int(i) for i in np.argwhere(values < 0)[0])
        raise ValueError(f"{name}{list(index)}={values[index]} is negative; loads must be finite numbers >= 0")
    one_layer = array.ndim == 1
    return np.ascontiguousarray(values.reshape(-1, array.shape[-1])), one_layer


def _check_table(
    table: Any, name: str, num_logical: int, num_layers: int | None, num_physical: int | None = None
) -> np.ndarray:
    """``table`` as int64 [L, P] (a [P] table for one layer); every logical id present."""
    if isinstance(table, Placement):
        table = table.physical_to_logical
    array = np.asarray(table)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(
            f"{name} must be an integer array [P] or [L, P], got shape {np.shape(table)} and dtype {array.dtype}"
        )
    layers, physical = array.shape
    if num_layers is not None and layers != num_layers:
        raise ValueError(
            f"{name} has {layers} layer(s) but load has {num_layers}; pass [{num_layers}, {num_physical or 'P'}]"
        )
    if num_physical is not None and physical != num_physical:
        raise ValueError(
            f"{name} has {physical} physical experts per layer; expected num_physical_experts={num_physical}"
        )
    if physical < num_logical:
        raise ValueError(
            f"{name} has {physical} physical experts per layer, fewer than the "
            f"{num_logical} logical experts; every logical expert needs a replica"
        )
    bad = (array < 0) | (array >= num_logical)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}{list(index)}={int(array[index])} is not a logical expert id; ids must be in [0, {num_logical})"
        )
    array = array.astype(np.int64)
    for layer in range(layers):
        missing = np.flatnonzero(np.bincount(array[layer], minlength=num_logical) == 0)
        if missing.size:
            raise ValueError(
                f"{name}[{layer}] holds no replica of logical expert(s) "
                f"{missing[:8].tolist()}; every id in [0, {num_logical}) must appear"
            )
    return np.ascontiguousarray(array)


def _check_ep(ep_size: Any, num_physical: int, name: str = "ep_size") -> int:
    ep_size = integer(name, ep_size, 1)
    if num_physical % ep_size:
        raise ValueError(
            f"{name}={ep_size} does not divide the {num_physical} physical experts; "
            f"use an ep_size that divides P (rank r holds [r*P/E, (r+1)*P/E))"
        )
    return ep_size


class Placement:
    """Where every replica of every logical expert lives, per layer.

    Attributes
    ----------
    physical_to_logical : numpy.ndarray int32 [L, P], read-only
        Logical expert of each physical expert; rank r holds [r*P/E, (r+1)*P/E).
    logical_to_physical : numpy.ndarray int32 [L, N, max_replicas], read-only
        Physical ids of each logical expert's replicas, ascending, padded with -1.
    replica_counts : numpy.ndarray int32 [L, N], read-only
    ep_size : int
        E.
    policy : str
        "hierarchical", "global", or "given" (built from a table).

    Parameters
    ----------
    physical_to_logical : array_like of int, [P] or [L, P]
        Every logical id in [0, N) at least once per layer.
    ep_size : int
        Must divide P.
    num_logical_experts : int, optional
        N; default the largest id + 1.

    Raises
    ------
    ValueError
        A table that is not integer [P] / [L, P], an id outside [0, N), a logical expert
        without a replica, an ep_size that does not divide P.
    """

    def __init__(
        self, physical_to_logical: Any, ep_size: int, num_logical_experts: int | None = None, *, policy: str = "given"
    ) -> None:
        if num_logical_experts is None:
            array = np.asarray(physical_to_logical)
            if array.size == 0 or not np.issubdtype(array.dtype, np.integer):
                raise ValueError("physical_to_logical must be a non-empty integer array [P] or [L, P]")
            num_logical_experts = int(array.max()) + 1
        n = integer("num_logical_experts", num_logical_experts, 1)
        table = _check_table(physical_to_logical, "physical_to_logical", n, None)
        self.ep_size = _check_ep(ep_size, table.shape[1])
        self.policy = policy
        self.physical_to_logical = _readonly(table.astype(_ID_DTYPE))
        counts = np.stack([np.bincount(row, minlength=n) for row in table])
        self.replica_counts = _readonly(counts.astype(_ID_DTYPE))
        width = int(counts.max())
        replicas = np.full((table.shape[0], n, width), -1, dtype=_ID_DTYPE)
        for layer, row in enumerate(table):
            order = np.argsort(row, kind="stable")  # ascending physical ids per expert
            rank_in_expert = np.arange(row.size) - np.repeat(np.cumsum(counts[layer]) - counts[layer], counts[layer])
            replicas[layer, row[order], rank_in_expert] = order
        self.logical_to_physical = _readonly(replicas)

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical_experts(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical_experts(self) -> int:
        return self.replica_counts.shape[1]

    @property
    def experts_per_rank(self) -> int:
        return self.num_physical_experts // self.ep_size

    def layer(self, index: int) -> np.ndarray:
        """int32 [P]: the ``physical_to_logical`` table of one layer (for ExpertLayout)."""
        return self.physical_to_logical[index]

    def moved(self, previous: Any) -> np.ndarray:
        """Physical experts per layer whose logical expert differs from ``previous``'s:
        the expert weights a switch from ``previous`` to this placement has to write.

        Parameters
        ----------
        previous : Placement or array_like int [P] / [L, P]

        Returns
        -------
        numpy.ndarray int64 [L]

        Raises
        ------
        ValueError
            ``previous`` of another shape than this placement's table.
        """
        table = _check_table(previous, "previous", self.num_logical_experts, self.num_layers, self.num_physical_experts)
        return (table != self.physical_to_logical).sum(axis=1).astype(np.int64)

    def duplicates(self) -> np.ndarray:
        """int64 [L]: replicas that share a rank with another replica of the same expert."""
        e, slots = self.ep_size, self.experts_per_rank
        out = np.zeros(self.num_layers, np.int64)
        for layer, row in enumerate(self.physical_to_logical):
            per_rank = row.reshape(e, slots)
            for rank_row in per_rank:
                out[layer] += slots - np.unique(rank_row).size
        return out

    def to_dict(self) -> dict:
        """Plain JSON-ready fields (``Placement.from_dict`` reads them back)."""
        return {
            "ep_size": self.ep_size,
            "num_logical_experts": self.num_logical_experts,
            "policy": self.policy,
            "physical_to_logical": self.physical_to_logical.tolist(),
        }

    @classmethod
    def from_dict(cls, fields: dict) -> "Placement":
        try:
            return cls(
                fields["physical_to_logical"],
                fields["ep_size"],
                fields.get("num_logical_experts"),
                policy=fields.get("policy", "given"),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"a placement needs physical_to_logical and ep_size: {error}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.ep_size == other.ep_size
            and self.num_logical_experts == other.num_logical_experts
            and np.array_equal(self.physical_to_logical, other.physical_to_logical)
        )

    def __repr__(self) -> str:
        return (
            f"Placement(layers={self.num_layers}, num_logical_experts={self.num_logical_experts}, "
            f"num_physical_experts={self.num_physical_experts}, ep_size={self.ep_size}, "
            f"policy={self.policy!r})"
        )


# --------------------------------------------------------------------------- metrics


def rank_load(load: Any, physical_to_logical: Any, ep_size: int) -> np.ndarray:
    """Tokens per rank of a placement, each logical load split evenly over its replicas.

    Parameters
    ----------
    load : array_like, [N] or [L, N], finite and >= 0
    physical_to_logical : Placement or array_like int, [P] or [L, P] (one table for every
        layer when [P])
    ep_size : int, dividing P

    Returns
    -------
    numpy.ndarray float64 [E] for a 1-D ``load``, else [L, E].

    Raises
    ------
    ValueError
        Bad loads (negative, non-finite, wrong rank), a table of the wrong length or with
        ids outside [0, N), an ep_size that does not divide P.
    """
    values, one_layer = _check_load(load)
    layers, n = values.shape
    table = _check_table(physical_to_logical, "physical_to_logical", n, None)
    if table.shape[0] == 1 and layers > 1:
        table = np.repeat(table, layers, axis=0)
    elif table.shape[0] != layers:
        raise ValueError(f"physical_to_logical has {table.shape[0]} layers but load has {layers}")
    e = _check_ep(ep_size, table.shape[1])
    counts = np.stack([np.bincount(row, minlength=n) for row in table])
    per_replica = values / counts
    physical = np.take_along_axis(per_replica, table, axis=1)
    loads = physical.reshape(layers, e, -1).sum(axis=2)
    return loads[0] if one_layer else loads


def _ratio(loads: np.ndarray) -> np.ndarray:
    peak = loads.max(axis=-1)
    mean = loads.mean(axis=-1)
    # No load at all is perfectly balanced.
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def balancedness(load: Any, physical_to_logical: Any, ep_size: int):
    """Mean rank load / max rank load, per layer (1.0 = perfectly even, 1/E = one rank
    does everything; 1.0 when there is no load).

    The rank loads are `rank_load`'s: each logical expert's load split evenly over its
    replicas (the module docstring says why).

    Returns
    -------
    float for a 1-D ``load``, else numpy.ndarray float64 [L].

    Raises
    ------
    ValueError
        As `rank_load`.
    """
    ratio = _ratio(np.atleast_2d(rank_load(load, physical_to_logical, ep_size)))
    return float(ratio[0]) if np.ndim(load) == 1 else ratio


def rank_load_from_physical(physical_load: Any, ep_size: int) -> np.ndarray:
    """Measured tokens per rank: each rank's physical counters summed.

    Parameters
    ----------
    physical_load : array_like, [P] or [L, P], finite and >= 0
        Tokens per routed physical expert (e.g. `moeroute.expert_load` of the routed
        physical ids), rank r's counters at [r*P/E, (r+1)*P/E).
    ep_size : int, dividing P

    Returns
    -------
    numpy.ndarray float64 [E] or [L, E].
    """
    values, one_layer = _check_load(physical_load, "physical_load")
    e = _check_ep(ep_size, values.shape[1])
    loads = values.reshape(values.shape[0], e, -1).sum(axis=2)
    return loads[0] if one_layer else loads


def balancedness_from_physical(physical_load: Any, ep_size: int):
    """Mean rank load / max rank load of measured physical counters, per layer.

    Returns float for [P], numpy.ndarray float64 [L] for [L, P]; raises as
    `rank_load_from_physical`.
    """
    ratio = _ratio(np.atleast_2d(rank_load_from_physical(physical_load, ep_size)))
    return float(ratio[0]) if np.ndim(physical_load) == 1 else ratio


def fold_physical_load(physical_load: Any, physical_to_logical: Any, num_logical_experts: int):
    """Tokens per logical expert: each physical counter added to its logical expert.

    Parameters
    ----------
    physical_load : array_like, [P] or [L, P], finite and >= 0
    physical_to_logical : Placement or array_like int, [P] or [L, P]
    num_logical_experts : int

    Returns
    -------
    numpy.ndarray float64 [N] or [L, N].
    """
    values, one_layer = _check_load(physical_load, "physical_load")
    n = integer("num_logical_experts", num_logical_experts, 1)
    table = _check_table(physical_to_logical, "physical_to_logical", n, None, values.shape[1])
    if table.shape[0] == 1 and values.shape[0] > 1:
        table = np.repeat(table, values.shape[0], axis=0)
    elif table.shape[0] != values.shape[0]:
        raise ValueError(f"physical_to_logical has {table.shape[0]} layers but physical_load has {values.shape[0]}")
    out = np.zeros((values.shape[0], n))
    for layer in range(values.shape[0]):
        np.add.at(out[layer], table[layer], values[layer])
    return out[0] if one_layer else out


def linear_placement(num_logical_experts: int, num_physical_experts: int, num_layers: int = 1) -> np.ndarray:
    """int32 [L, P]: ExpertLayout's default ("linear"): physical p computes p % N."""
    table = np.arange(num_physical_experts) % num_logical_experts
    return np.tile(table, (num_layers, 1)).astype(_ID_DTYPE)


def round_robin_placement(
    num_logical_experts: int, num_physical_experts: int, ep_size: int, num_layers: int = 1
) -> np.ndarray:
    """int32 [L, P]: ExpertLayout's "round_robin": rank r holds entries r, r+E, ... of linear."""
    linear = np.arange(num_physical_experts) % num_logical_experts
    table = np.concatenate([linear[rank::ep_size] for rank in range(ep_size)])
    return np.tile(table, (num_layers, 1)).astype(_ID_DTYPE)


# --------------------------------------------------------------------------- rebalance


def rebalance(
    load: Any, num_physical_experts: int, ep_size: int, *, num_nodes: int = 1, num_groups: int = 1, previous: Any = None
) -> Placement:
    """A placement of P physical experts on E ranks balancing ``load``.

    Policy (DeepSeek EPLB's meaning): hierarchical when ``num_groups % num_nodes == 0``:
    the N/G-expert groups are packed onto the nodes (heaviest group first, into the
    lightest node with room), each node's experts get the node's P/num_nodes physical slots
    (one replica each, then every extra replica to the expert with the highest load per
    replica), and the node's replicas are packed onto its ranks the same way. Otherwise
    global: the same with one node and one group. With the defaults (one node, one group)
    both are the same.

    The result is at least as balanced as that greedy on every layer (its heaviest rank is
    never heavier), refined by swaps between each node's heaviest rank and its lighter
    ranks. Two replicas of one expert share a rank only where neither a packing that
    avoids it nor a swap under the greedy's heaviest rank removes it. Swaps never cross
    nodes under the hierarchical policy.

    Parameters
    ----------
    load : array_like, [N] or [L, N]
        Tokens (or any non-negative, finite weight) per logical expert, per layer.
    num_physical_experts : int
        P >= N, a multiple of ``ep_size``; P - N replicas are placed.
    ep_size : int
        E, the number of expert-parallel ranks; a multiple of ``num_nodes``.
    num_nodes : int
        Nodes the ranks are spread over (ranks [k*E/nodes, (k+1)*E/nodes) on node k).
    num_groups : int
        Expert groups (DeepSeek-V3: 8); must divide N.
    previous : Placement or array_like int [P] / [L, P], optional
        The placement in use. The new plan's ranks are renumbered and each rank's experts
        reordered so that an expert that keeps a replica on a rank keeps its slot there.
        ``previous`` improved by swaps is taken instead when it stays at least as balanced
        as the greedy, with no more duplicates and fewer moves (an unchanged load moves
        nothing). It never moves more experts than the plan made without ``previous``.

    Returns
    -------
    Placement
        ``physical_to_logical`` [L, P] (a one-layer [N] load gives L = 1).

    Raises
    ------
    ValueError
        A load that is not [N] / [L, N], negative or non-finite; P < N; P not a multiple
        of ep_size; num_groups not dividing N; num_nodes not dividing ep_size; a
        ``previous`` of another shape or with ids outside [0, N). The message names the
        argument and the allowed values.

    Examples
    --------
    >>> plan = rebalance([90, 10, 10, 10, 30], 8, 2)
    >>> plan.replica_counts.tolist()
    [[4, 1, 1, 1, 1]]
    >>> round(balancedness([90, 10, 10, 10, 30], plan, 2), 3)
    0.968
    """
    values, _ = _check_load(load)
    layers, n = values.shape
    p = integer("num_physical_experts", num_physical_experts, 1)
    if p < n:
        raise ValueError(
            f"num_physical_experts={p} is smaller than the {n} logical experts; "
            f"use num_physical_experts >= {n} (every expert needs a replica)"
        )
    e = integer("ep_size", ep_size, 1)
    if p % e:
        raise ValueError(
            f"num_physical_experts={p} is not a multiple of ep_size={e}; every rank "
            f"holds P/E experts: use P in {{{(p // e) * e or e}, {(p // e + 1) * e}}}"
        )
    nodes = integer("num_nodes", num_nodes, 1)
    if e % nodes:
        raise ValueError(
            f"num_nodes={nodes} does not divide ep_size={e}; use a num_nodes among "
            f"{[d for d in range(1, e + 1) if e % d == 0]}"
        )
    groups = integer("num_groups", num_groups, 1)
    if n % groups:
        raise ValueError(
            f"num_groups={groups} does not divide the {n} logical experts; use a "
            f"num_groups among {[d for d in range(1, n + 1) if n % d == 0]}"
        )
    hierarchical = groups % nodes == 0
    policy_nodes, policy_groups = (nodes, groups) if hierarchical else (1, 1)
    if previous is not None:
        prev = _check_table(previous, "previous", n, layers, p)
    else:
        prev = np.zeros((layers, p), np.int64)
    table = _policy._plan_layers(values, p, e, policy_nodes, policy_groups, prev, previous is not None)
    return Placement(table, e, n, policy="hierarchical" if hierarchical else "global")
