"""The rebalancing policy, compiled with Numba: greedy plan, swap refinement, slot keeping.

All functions work on float64 loads and int64 ids of one layer (``_plan_layers`` loops over
the layers). A plan is ``phy2log`` [P]: rank r holds physical ids [r*S, (r+1)*S), S = P/E.

Steps of one layer:

1. DeepSeek's greedy (``_greedy``): hierarchical when asked (expert groups packed onto
   nodes, experts replicated inside each node, replicas packed onto the node's ranks),
   else the same with one node and one group. Ties: the lower index wins everywhere.
2. A second start that packs each replica into the lightest rank with room that does not
   already hold its logical expert (``avoid_duplicates``).
3. Each start is refined (``_refine``): swaps between the heaviest rank of a node and any
   lighter rank of the same node, best swap first, never creating a duplicate; then
   duplicates are removed by swaps that keep every rank at or under the layer's heaviest
   rank (``_remove_duplicates``), and refined again.
4. Of the starts whose heaviest rank is at most the greedy's, the one with the fewest
   duplicates wins, then the lighter heaviest rank.
5. With a previous placement: the plan's ranks are renumbered (nodes, then ranks inside
   each node) to overlap the previous ones most and each rank's experts take the slots
   they held; the previous placement improved by swaps competes with it when its heaviest
   rank is at most the greedy's, and wins when it has no more duplicates and moves no more
   experts.

Swaps never cross nodes under the hierarchical policy, so every expert stays on the node
its group was packed onto.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: Relative slack of load comparisons: a swap must lower the heaviest rank by more than
#: this fraction of it (float sums in another order differ in the last bits).
RELATIVE_TOLERANCE = 1e-12
#: Swap rounds per node and pass, in units of physical experts: each round strictly lowers
#: the heaviest rank, so this only bounds pathological float cases.
ROUNDS_PER_EXPERT = 4


@njit(cache=True)
def _pack(weights, num_packs, pack_of, slot_of):
    """DeepSeek's balanced packing: heaviest first into the lightest pack with room."""
    n = weights.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        for i in range(n):
            pack_of[i] = i
            slot_of[i] = 0
        return
    order = np.argsort(-weights, kind="mergesort")
    pack_load = np.zeros(num_packs)
    pack_size = np.zeros(num_packs, np.int64)
    for i in range(n):
        item = order[i]
        best = -1
        for p in range(num_packs):
            if pack_size[p] < per_pack and (best < 0 or pack_load[p] < pack_load[best]):
                best = p
        pack_of[item] = best
        slot_of[item] = pack_size[best]
        pack_size[best] += 1
        pack_load[best] += weights[item]


@njit(cache=True)
def _pack_avoiding(weights, logical, num_logical, num_packs, pack_of, slot_of):
    """`_pack`, but a replica skips packs already holding its logical expert when it can."""
    n = weights.shape[0]
    per_pack = n // num_packs
    order = np.argsort(-weights, kind="mergesort")
    pack_load = np.zeros(num_packs)
    pack_size = np.zeros(num_packs, np.int64)
    held = np.zeros((num_packs, num_logical), np.int64)
    for i in range(n):
        item = order[i]
        best, fallback = -1, -1
        for p in range(num_packs):
            if pack_size[p] >= per_pack:
                continue
            if fallback < 0 or pack_load[p] < pack_load[fallback]:
                fallback = p
            if held[p, logical[item]] == 0 and (best < 0 or pack_load[p] < pack_load[best]):
                best = p
        if best < 0:
            best = fallback
        pack_of[item] = best
        slot_of[item] = pack_size[best]
        pack_size[best] += 1
        pack_load[best] += weights[item]
        held[best, logical[item]] += 1


@njit(cache=True)
def _replicate(weights, num_physical, counts):
    """Replicas: one per expert, then each extra one to the highest load per replica."""
    n = weights.shape[0]
    phy2log = np.empty(num_physical, np.int64)
    for i in range(n):
        phy2log[i] = i
        counts[i] = 1
    for i in range(n, num_physical):
        best = 0
        best_value = weights[0] / counts[0]
        for j in range(1, n):
            value = weights[j] / counts[j]
            if value > best_value:
                best, best_value = j, value
        phy2log[i] = best
        counts[best] += 1
    return phy2log


@njit(cache=True)
def _greedy(load, num_physical, num_ranks, num_nodes, num_groups, avoid_duplicates):
    """One layer's greedy plan ``phy2log`` [P]; hierarchical when num_nodes/num_groups > 1."""
    n = load.shape[0]
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    # Expert groups onto nodes; "meta-logical" ids number the experts node by node.
    group_load = np.zeros(num_groups)
    for g in range(num_groups):
        for j in range(group_size):
            group_load[g] += load[g * group_size + j]
    group_node = np.empty(num_groups, np.int64)
    group_slot = np.empty(num_groups, np.int64)
    _pack(group_load, num_nodes, group_node, group_slot)
    meta2log = np.empty(n, np.int64)
    for g in range(num_groups):
        base = (group_node[g] * groups_per_node + group_slot[g]) * group_size
        for j in range(group_size):
            meta2log[base + j] = g * group_size + j

    logical_per_node = n // num_nodes
    physical_per_node = num_physical // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots = num_physical // num_ranks
    phy2log = np.empty(num_physical, np.int64)
    for node in range(num_nodes):
        node_load = np.empty(logical_per_node)
        for j in range(logical_per_node):
            node_load[j] = load[meta2log[node * logical_per_node + j]]
        counts = np.empty(logical_per_node, np.int64)
        phy2meta = _replicate(node_load, physical_per_node, counts)
        weights = np.empty(physical_per_node)
        for i in range(physical_per_node):
            weights[i] = node_load[phy2meta[i]] / counts[phy2meta[i]]
        pack_of = np.empty(physical_per_node, np.int64)
        slot_of = np.empty(physical_per_node, np.int64)
        if avoid_duplicates:
            _pack_avoiding(weights, phy2meta, logical_per_node, ranks_per_node, pack_of, slot_of)
        else:
            _pack(weights, ranks_per_node, pack_of, slot_of)
        for i in range(physical_per_node):
            rank = node * ranks_per_node + pack_of[i]
            phy2log[rank * slots + slot_of[i]] = meta2log[node * logical_per_node + phy2meta[i]]
    return phy2log


@njit(cache=True)
def _replica_counts(phy2log, n):
    counts = np.zeros(n, np.int64)
    for p in range(phy2log.shape[0]):
        counts[phy2log[p]] += 1
    return counts


@njit(cache=True)
def _rank_loads(load, phy2log, counts, num_ranks):
    slots = phy2log.shape[0] // num_ranks
    loads = np.zeros(num_ranks)
    for r in range(num_ranks):
        for s in range(slots):
            logical = phy2log[r * slots + s]
            loads[r] += load[logical] / counts[logical]
    return loads


@njit(cache=True)
def _held(phy2log, n, num_ranks):
    """[E, N]: replicas of each logical expert on each rank."""
    slots = phy2log.shape[0] // num_ranks
    held = np.zeros((num_ranks, n), np.int64)
    for p in range(phy2log.shape[0]):
        held[p // slots, phy2log[p]] += 1
    return held


@njit(cache=True)
def _duplicates(held):
    total = 0
    for r in range(held.shape[0]):
        for j in range(held.shape[1]):
            if held[r, j] > 1:
                total += held[r, j] - 1
    return total


@njit(cache=True)
def _swap(phy2log, weights, loads, held, a, b, slots):
    ra, rb = a // slots, b // slots
    la, lb = phy2log[a], phy2log[b]
    loads[ra] += weights[b] - weights[a]
    loads[rb] += weights[a] - weights[b]
    held[ra, la] -= 1
    held[ra, lb] += 1
    held[rb, lb] -= 1
    held[rb, la] += 1
    phy2log[a], phy2log[b] = lb, la
    weights[a], weights[b] = weights[b], weights[a]


@njit(cache=True)
def _refine(phy2log, weights, loads, held, num_ranks, num_nodes):
    """Best swaps between each node's heaviest rank and its lighter ranks, until none helps."""
    slots = phy2log.shape[0] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    for node in range(num_nodes):
        first = node * ranks_per_node
        for _ in range(ROUNDS_PER_EXPERT * phy2log.shape[0]):
            heavy = first
            for r in range(first, first + ranks_per_node):
                if loads[r] > loads[heavy]:
                    heavy = r
            target = loads[heavy] * (1.0 - RELATIVE_TOLERANCE)
            best_value, best_a, best_b = target, -1, -1
            for r in range(first, first + ranks_per_node):
                if r == heavy or loads[r] >= loads[heavy]:
                    continue
                for a in range(heavy * slots, (heavy + 1) * slots):
                    la = phy2log[a]
                    for b in range(r * slots, (r + 1) * slots):
                        lb = phy2log[b]
                        delta = weights[a] - weights[b]
                        if delta <= 0.0 or la == lb:
                            continue
                        value = max(loads[heavy] - delta, loads[r] + delta)
                        if value >= best_value:
                            continue
                        if held[r, la] > 0 or held[heavy, lb] > 0:
                            continue  # never create a duplicate
                        best_value, best_a, best_b = value, a, b
            if best_a < 0:
                break
            _swap(phy2log, weights, loads, held, best_a, best_b, slots)


@njit(cache=True)
def _remove_duplicates(phy2log, weights, loads, held, num_ranks, num_nodes, limit):
    """Swap a duplicate replica away wherever both ranks stay at or under ``limit``."""
    slots = phy2log.shape[0] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    for a in range(phy2log.shape[0]):
        ra = a // slots
        la = phy2log[a]
        if held[ra, la] < 2:
            continue
        first = (ra // ranks_per_node) * ranks_per_node
        best_value, best_b = np.inf, -1
        for rb in range(first, first + ranks_per_node):
            if rb == ra or held[rb, la] > 0:
                continue
            for b in range(rb * slots, (rb + 1) * slots):
                lb = phy2log[b]
                if held[ra, lb] > 0:
                    continue
                new_a = loads[ra] - weights[a] + weights[b]
                new_b = loads[rb] + weights[a] - weights[b]
                value = max(new_a, new_b)
                if value <= limit and value < best_value:
                    best_value, best_b = value, b
        if best_b >= 0:
            _swap(phy2log, weights, loads, held, a, best_b, slots)


@njit(cache=True)
def _improve(load, phy2log, num_ranks, num_nodes, limit):
    """Refine, remove duplicates under ``limit``, refine again; returns the heaviest load."""
    n = load.shape[0]
    counts = _replica_counts(phy2log, n)
    weights = np.empty(phy2log.shape[0])
    for p in range(phy2log.shape[0]):
        weights[p] = load[phy2log[p]] / counts[phy2log[p]]
    loads = _rank_loads(load, phy2log, counts, num_ranks)
    held = _held(phy2log, n, num_ranks)
    _refine(phy2log, weights, loads, held, num_ranks, num_nodes)
    if _duplicates(held) > 0:
        _remove_duplicates(phy2log, weights, loads, held, num_ranks, num_nodes, min(limit, loads.max()))
        _refine(phy2log, weights, loads, held, num_ranks, num_nodes)
    # Recomputed from scratch: the running sums drift by the swaps' rounding.
    return _rank_loads(load, phy2log, counts, num_ranks).max()


@njit(cache=True)
def _greedy_peak(load, num_physical, num_ranks, num_nodes, num_groups):
    """The heaviest rank of DeepSeek's greedy, with the comparison slack added."""
    greedy = _greedy(load, num_physical, num_ranks, num_nodes, num_groups, False)
    counts = _replica_counts(greedy, load.shape[0])
    return _rank_loads(load, greedy, counts, num_ranks).max() * (1.0 + RELATIVE_TOLERANCE)


@njit(cache=True)
def _plan_layer(load, num_physical, num_ranks, num_nodes, num_groups, allowed):
    """The chosen plan of one layer (see the module docstring)."""
    n = load.shape[0]
    best = _greedy(load, num_physical, num_ranks, num_nodes, num_groups, False)
    best_peak = _improve(load, best, num_ranks, num_nodes, allowed)
    best_dups = _duplicates(_held(best, n, num_ranks))
    if best_dups == 0:
        return best
    other = _greedy(load, num_physical, num_ranks, num_nodes, num_groups, True)
    peak = _improve(load, other, num_ranks, num_nodes, allowed)
    dups = _duplicates(_held(other, n, num_ranks))
    if peak <= allowed and (dups < best_dups or (dups == best_dups and peak < best_peak)):
        return other
    return best


# --------------------------------------------------------------------------- keeping slots


@njit(cache=True)
def _match(overlap):
    """Greedy assignment: repeatedly pair the unmatched (new, old) with the largest overlap."""
    k = overlap.shape[0]
    new_to_old = np.full(k, -1, np.int64)
    used_new = np.zeros(k, np.bool_)
    used_old = np.zeros(k, np.bool_)
    for _ in range(k):
        best, bi, bj = -1, -1, -1
        for i in range(k):
            if used_new[i]:
                continue
            for j in range(k):
                if not used_old[j] and overlap[i, j] > best:
                    best, bi, bj = overlap[i, j], i, j
        new_to_old[bi] = bj
        used_new[bi] = True
        used_old[bj] = True
    return new_to_old


@njit(cache=True)
def _relabel_ranks(plan, previous, n, num_ranks, num_nodes):
    """``plan`` with its ranks renumbered (nodes first, then ranks inside each node) so
    that each rank's experts overlap the previous ones of its new number the most."""
    slots = plan.shape[0] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    held_new = _held(plan, n, num_ranks)
    held_old = _held(previous, n, num_ranks)
    rank_overlap = np.zeros((num_ranks, num_ranks), np.int64)
    for a in range(num_ranks):
        for b in range(num_ranks):
            total = 0
            for j in range(n):
                total += min(held_new[a, j], held_old[b, j])
            rank_overlap[a, b] = total
    node_overlap = np.zeros((num_nodes, num_nodes), np.int64)
    for x in range(num_nodes):
        for y in range(num_nodes):
            for j in range(n):
                a_total, b_total = 0, 0
                for r in range(ranks_per_node):
                    a_total += held_new[x * ranks_per_node + r, j]
                    b_total += held_old[y * ranks_per_node + r, j]
                node_overlap[x, y] += min(a_total, b_total)
    node_map = _match(node_overlap)
    out = np.empty_like(plan)
    for x in range(num_nodes):
        y = node_map[x]
        sub = rank_overlap[
            x * ranks_per_node : (x + 1) * ranks_per_node, y * ranks_per_node : (y + 1) * ranks_per_node
        ].copy()
        rank_map = _match(sub)
        for r in range(ranks_per_node):
            source = x * ranks_per_node + r
            target = y * ranks_per_node + rank_map[r]
            for s in range(slots):
                out[target * slots + s] = plan[source * slots + s]
    return out


@njit(cache=True)
def _keep_slots(plan, previous, num_ranks):
    """Each rank's experts reordered so an expert the rank held before keeps its slot."""
    slots = plan.shape[0] // num_ranks
    out = np.full(plan.shape[0], -1, np.int64)
    for r in range(num_ranks):
        base = r * slots
        taken = np.zeros(slots, np.bool_)  # items of plan's rank r already placed
        for s in range(slots):
            for i in range(slots):
                if not taken[i] and plan[base + i] == previous[base + s]:
                    out[base + s] = plan[base + i]
                    taken[i] = True
                    break
        free = 0
        for i in range(slots):
            if taken[i]:
                continue
            while out[base + free] >= 0:
                free += 1
            out[base + free] = plan[base + i]
    return out


@njit(cache=True)
def _moved(plan, previous):
    total = 0
    for p in range(plan.shape[0]):
        if plan[p] != previous[p]:
            total += 1
    return total


@njit(cache=True)
def _follow_previous(load, plan, previous, num_ranks, num_nodes, allowed):
    """(a) ``plan`` with its ranks renumbered and its slots matched to ``previous``, or
    (b) ``previous`` improved by swaps when its heaviest rank is at most ``allowed`` (the
    greedy's) and it has no more duplicates and moves no more experts than (a)."""
    n = load.shape[0]
    kept = _keep_slots(plan, previous, num_ranks)
    relabeled = _keep_slots(_relabel_ranks(plan, previous, n, num_ranks, num_nodes), previous, num_ranks)
    if _moved(relabeled, previous) < _moved(kept, previous):
        kept = relabeled
    swapped = previous.copy()
    peak = _improve(load, swapped, num_ranks, num_nodes, allowed)
    if peak <= allowed:
        # An expert swapped away and back later returns to its old slot.
        swapped = _keep_slots(swapped, previous, num_ranks)
        dups_swapped = _duplicates(_held(swapped, n, num_ranks))
        dups_kept = _duplicates(_held(kept, n, num_ranks))
        if dups_swapped <= dups_kept and _moved(swapped, previous) <= _moved(kept, previous):
            return swapped
    return kept


@njit(cache=True)
def _plan_layers(load, num_physical, num_ranks, num_nodes, num_groups, previous, has_previous):
    """Plans of every layer: int64 [L, P]."""
    layers = load.shape[0]
    out = np.empty((layers, num_physical), np.int64)
    for layer in range(layers):
        allowed = _greedy_peak(load[layer], num_physical, num_ranks, num_nodes, num_groups)
        plan = _plan_layer(load[layer], num_physical, num_ranks, num_nodes, num_groups, allowed)
        if has_previous:
            plan = _follow_previous(load[layer], plan, previous[layer], num_ranks, num_nodes, allowed)
        out[layer] = plan
    return out
