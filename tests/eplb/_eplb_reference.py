"""Plain-Python references for the EPLB tests, written from the definitions, not the code.

DeepSeek's greedy (the baseline the rebalancer must match or beat):
* replicate: every logical expert gets one replica; each further replica goes to the
  expert whose load per replica is the highest (the lower id on ties);
* pack: items sorted by weight, heaviest first (the lower index on ties), each into the
  lightest pack that still has room (the lower pack on ties); one item per pack: item i
  goes to pack i;
* hierarchical (num_groups % num_nodes == 0): the groups (N/G consecutive experts) are
  packed onto the nodes by group load; each node replicates its experts into P/num_nodes
  physical experts, and packs them onto its E/num_nodes ranks. Otherwise: one node, one
  group.
The rank load of a placement splits each logical load evenly over its replicas.
"""

from __future__ import annotations


def pack(weights, num_packs):
    n = len(weights)
    per_pack = n // num_packs
    if per_pack == 1:
        return list(range(n))
    order = sorted(range(n), key=lambda i: -weights[i])
    loads, sizes, owner = [0.0] * num_packs, [0] * num_packs, [None] * n
    for item in order:
        pack_id = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: loads[p])
        owner[item] = pack_id
        sizes[pack_id] += 1
        loads[pack_id] += weights[item]
    return owner


def replicate(weights, num_physical):
    counts = [1] * len(weights)
    for _ in range(num_physical - len(weights)):
        best = max(range(len(weights)), key=lambda j: weights[j] / counts[j])
        counts[best] += 1
    return counts


def greedy_rank_loads(load, num_physical, ep_size, num_nodes=1, num_groups=1):
    """Per-rank loads of DeepSeek's greedy placement of one layer (list of E floats)."""
    n = len(load)
    if num_groups % num_nodes:
        num_nodes = num_groups = 1
    group_size = n // num_groups
    group_loads = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    group_node = pack(group_loads, num_nodes)
    ranks_per_node = ep_size // num_nodes
    rank_loads = []
    for node in range(num_nodes):
        experts = [g * group_size + j for g in range(num_groups) if group_node[g] == node for j in range(group_size)]
        node_load = [load[e] for e in experts]
        counts = replicate(node_load, num_physical // num_nodes)
        # The order of the replicas: first one per expert, then the extra ones in the
        # order they were added (ties in weight need this order to match the packing).
        items = list(range(len(node_load)))
        extra_counts = [1] * len(node_load)
        for _ in range(num_physical // num_nodes - len(node_load)):
            best = max(range(len(node_load)), key=lambda j: node_load[j] / extra_counts[j])
            extra_counts[best] += 1
            items.append(best)
        weights = [node_load[j] / counts[j] for j in items]
        owner = pack(weights, ranks_per_node)
        loads = [0.0] * ranks_per_node
        for item, rank in enumerate(owner):
            loads[rank] += weights[item]
        rank_loads.extend(loads)
    return rank_loads


def rank_loads(load, physical_to_logical, ep_size):
    """Per-rank loads of a placement of one layer, each load split evenly over its replicas."""
    counts = {}
    for logical in physical_to_logical:
        counts[logical] = counts.get(logical, 0) + 1
    per_rank = len(physical_to_logical) // ep_size
    return [
        sum(load[x] / counts[x] for x in physical_to_logical[r * per_rank : (r + 1) * per_rank]) for r in range(ep_size)
    ]


def balancedness(rank_load_list):
    peak = max(rank_load_list)
    return 1.0 if peak == 0 else (sum(rank_load_list) / len(rank_load_list)) / peak


def duplicates(physical_to_logical, ep_size):
    per_rank = len(physical_to_logical) // ep_size
    return sum(per_rank - len(set(physical_to_logical[r * per_rank : (r + 1) * per_rank])) for r in range(ep_size))


def pack_avoiding_rank_loads(load, num_physical, ep_size):
    """Global greedy whose packing skips ranks already holding the expert when it can:
    (rank loads, duplicates)."""
    n = len(load)
    counts = replicate(load, num_physical)
    items = list(range(n))
    extra = [1] * n
    for _ in range(num_physical - n):
        best = max(range(n), key=lambda j: load[j] / extra[j])
        extra[best] += 1
        items.append(best)
    weights = [load[j] / counts[j] for j in items]
    per_rank = num_physical // ep_size
    order = sorted(range(len(items)), key=lambda i: -weights[i])
    loads, sizes, held = [0.0] * ep_size, [0] * ep_size, [set() for _ in range(ep_size)]
    dups = 0
    for i in order:
        open_ranks = [r for r in range(ep_size) if sizes[r] < per_rank]
        free = [r for r in open_ranks if items[i] not in held[r]]
        rank = min(free or open_ranks, key=lambda r: loads[r])
        dups += items[i] in held[rank]
        held[rank].add(items[i])
        sizes[rank] += 1
        loads[rank] += weights[i]
    return loads, dups
