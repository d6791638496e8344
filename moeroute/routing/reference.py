"""Plain NumPy definitions of every routing and dispatch operation.

These are the specification in executable form: short, vectorised where that keeps them
readable, and never used on a hot path. The compiled kernels (CPU and CUDA) are tested
against them; nothing here imports a kernel.

Numerical conventions shared by all implementations
----------------------------------------------------
* Scores are computed in float32 from logits cast to float32.
* A NaN logit counts as ``-inf``; logits are clamped to the finite float32 range first, so
  scores are always finite: a ``+inf`` logit wins, an all ``-inf`` row is uniform (softmax).
  Scorings: softmax, sigmoid, ``sqrt(softplus(x))`` and "none" (the clipped logits).
* Ranking is by ``choice`` descending; a NaN choice (only a NaN correction bias makes one)
  ranks below every other value; ties go to the lower expert id (and the lower group id).
"""

from __future__ import annotations

import numpy as np

from moeroute._validate import weights_then_ids

FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
RENORMALIZE_EPS = 1e-20  # added to the weight sum before dividing (docs/semantics.md section 1, rule 5)
# Knuth's multiplicative hash constant (2**32 / golden ratio): spreads consecutive token
# rows over the replicas of an expert.
REPLICA_HASH_MULTIPLIER = 2654435769


def _descending_order(values: np.ndarray) -> np.ndarray:
    """Column order that ranks ``values`` (last axis) descending, NaN last, ties by index."""
    index = np.broadcast_to(np.arange(values.shape[-1]), values.shape)
    nan = np.isnan(values)
    key = np.where(nan, np.float32(0), values)
    # lexsort: the last key is primary. Not-NaN first, then value descending, then index.
    return np.lexsort((index, -key, nan), axis=-1)


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    x = logits.astype(np.float32)
    x = np.where(np.isnan(x), np.float32(-np.inf), x)
    x = np.clip(x, -FLOAT32_MAX, FLOAT32_MAX)
    with np.errstate(over="ignore", under="ignore"):
        if scoring == "sigmoid":
            return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)
        if scoring == "sqrtsoftplus":
            # softplus(x) = max(x, 0) + log1p(exp(-|x|)): finite for every finite x.
            softplus = np.maximum(x, np.float32(0)) + np.log1p(np.exp(-np.abs(x)))
            return np.sqrt(softplus.astype(np.float32)).astype(np.float32)
        if scoring == "none":
            return x.astype(np.float32)
        shifted = x - x.max(axis=-1, keepdims=True)
        e = np.exp(shifted.astype(np.float32))
        return (e / e.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)


def select_experts(logits, config, correction_bias=None):
    """Top-k routing (docs/semantics.md section 1).

    Parameters
    ----------
    logits : ndarray [T, N], float32 or float16
    config : moeroute.RouterConfig
    correction_bias : ndarray [N] float32, optional

    Returns
    -------
    topk_weights : ndarray [T, K] float32 (scoring "none": see `_raw_logit_weights`)
    topk_ids : ndarray [T, K] int32, columns ordered by choice descending
    """
    logits = np.asarray(logits)
    T, N = logits.shape
    K = config.top_k
    scores = _scores(logits, config.scoring)
    choice = scores if correction_bias is None else scores + np.asarray(correction_bias, np.float32)

    G = config.num_expert_group
    allowed = np.ones((T, N), dtype=bool)
    if G > 1:
        per_group = N // G
        grouped = choice.reshape(T, G, per_group)
        order = _descending_order(grouped)
        ranked = np.take_along_axis(grouped, order, axis=-1)
        if correction_bias is not None:
            group_score = ranked[..., 0] + ranked[..., 1]
        else:
            group_score = ranked[..., 0]
        kept = _descending_order(group_score)[:, : config.topk_group]
        kept_mask = np.zeros((T, G), dtype=bool)
        np.put_along_axis(kept_mask, kept, True, axis=-1)
        allowed = np.repeat(kept_mask, per_group, axis=-1)

    # Disallowed experts sort after every allowed one, NaN choices included.
    masked = np.where(allowed, choice, np.float32(np.nan))
    not_allowed = ~allowed
    index = np.broadcast_to(np.arange(N), (T, N))
    nan = np.isnan(masked) & allowed
    key = np.where(np.isnan(masked), np.float32(0), masked)
    order = np.lexsort((index, -key, nan, not_allowed), axis=-1)
    topk_ids = order[:, :K].astype(np.int32)

    weights = np.take_along_axis(scores, topk_ids, axis=-1).astype(np.float32)
    if config.scoring == "none":
        return _raw_logit_weights(weights, config), topk_ids
    if config.renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True, dtype=np.float32) + np.float32(RENORMALIZE_EPS))
    weights = (weights * np.float32(config.routed_scaling_factor)).astype(np.float32)
    return weights, topk_ids


def _raw_logit_weights(weights, config):
    """Weights of scoring "none": the picked (clipped) logits, divided by their float32 sum
    (taken in pick order) plus 1e-20 when renormalize is set and that divisor is positive
    and finite (a sum <= -1e-20 or an overflowed one leaves them as they are), times rsf,
    clamped to the finite float32 range so that every weight is finite."""
    weights = weights.astype(np.float32)
    out = np.empty_like(weights)
    for t in range(weights.shape[0]):
        total = np.float32(0)
        with np.errstate(over="ignore"):
            for k in range(weights.shape[1]):
                total = np.float32(total + weights[t, k])
            divisor = np.float32(total + np.float32(RENORMALIZE_EPS))
            row = weights[t]
            if config.renormalize and np.float32(0) < divisor <= FLOAT32_MAX:
                row = (row / divisor).astype(np.float32)
            row = (row * np.float32(config.routed_scaling_factor)).astype(np.float32)
        out[t] = np.clip(row, -FLOAT32_MAX, FLOAT32_MAX)
    return out


def logical_to_physical(topk_ids, layout, prefer_rank=None):
    """Map logical routed ids to ids in the layout's physical id space.

    Redundant experts: logical ``l`` of token row ``t`` goes to
    ``replicas[((t * 2654435769) mod 2**32) % count]``, the replicas being the routed
    physical ids ``p`` with ``layout.physical_to_logical[p] == l`` in ascending order, or,
    with ``prefer_rank``, only those inside that rank's routed range when there are any.
    Then per-rank shared slots shift the routed physical id by its owner's rank times S
    (``layout.routed_id_map``). Ids outside ``[0, N)`` become -1.

    topk_ids : ndarray [T, K] int -> ndarray [T, K] int32
    """
    topk_ids = np.asarray(topk_ids)
    T = topk_ids.shape[0]
    out = np.full(topk_ids.shape, -1, dtype=np.int32)
    table = np.asarray(layout.physical_to_logical)
    local = np.zeros(table.shape[0], dtype=bool)
    if prefer_rank is not None:
        start, count = layout.routed_range(prefer_rank)
        local[start : start + count] = True
    for t in range(T):
        h = (t * REPLICA_HASH_MULTIPLIER) % (1 << 32)
        for k in range(topk_ids.shape[1]):
            logical = int(topk_ids[t, k])
            if 0 <= logical < layout.num_routed_experts:
                replicas = np.flatnonzero(table == logical)
                if local[replicas].any():
                    replicas = replicas[local[replicas]]
                physical = int(replicas[h % replicas.shape[0]])
                out[t, k] = layout.routed_id_map[physical]
    return out


def expert_load(ids, num_experts):
    """Tokens per expert: ``counts[e]`` = entries of ``ids`` (any shape) equal to e, for e in
    [0, num_experts); other ids are not counted. Returns int64 [num_experts]."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return np.bincount(flat, minlength=num_experts).astype(np.int64)


def append_shared_slots(topk_weights, topk_ids, layout, home_rank=0, shared_weights=None):
    """Weights and physical ids with the fused shared slots appended (docs/semantics.md section 4).

    topk_weights : ndarray [T, K] float32
    topk_ids : ndarray [T, K] int (logical routed ids)
    shared_weights : None (1.0), a scalar, ndarray [T] or [T, S] float32: the slot weight,
        i.e. ``layout.shared_slot_weight(gate, rsf)``.

    Returns weights float32 [T, K + S'] and ids int32 [T, K + S'] with S' = S when the
    layout fuses the shared experts and 0 otherwise. TypeError for non-float weights or
    non-integer ids (ids passed first, the order before 0.2).
    """
    weights_then_ids(topk_weights, topk_ids)
    ids = logical_to_physical(topk_ids, layout)
    weights = np.asarray(topk_weights, dtype=np.float32)
    T = ids.shape[0]
    S = layout.num_shared_experts if layout.shared == "fused" else 0
    if S == 0:
        return weights.copy(), ids
    slot_ids = np.broadcast_to(layout.shared_slot_ids(home_rank), (T, S))
    if shared_weights is None:
        shared_weights = np.float32(1)
    slot_weights = np.asarray(shared_weights, dtype=np.float32)
    if slot_weights.ndim == 1:
        slot_weights = slot_weights[:, None]
    slot_weights = np.broadcast_to(slot_weights, (T, S))
    return (
        np.concatenate([weights, slot_weights], axis=1).astype(np.float32),
        np.concatenate([ids, slot_ids], axis=1).astype(np.int32),
    )


def remap_to_local(ids, expert_map):
    """Physical -> local ids for one rank: ``expert_map[id]``, -1 when not held or out of range."""
    ids = np.asarray(ids)
    expert_map = np.asarray(expert_map)
    valid = (ids >= 0) & (ids < expert_map.shape[0])
    return np.where(valid, expert_map[np.where(valid, ids, 0)], -1).astype(np.int32)


def align_block_size(topk_ids, num_experts, block_size, expert_map=None):
    """Expert-sorted, block-padded flat indices (docs/semantics.md section 4, to the letter).

    With ``expert_map`` the ids are ``remap_to_local(topk_ids, expert_map)`` first.
    Returns sorted_token_ids int32 [numel + num_experts*(B-1) rounded up to B],
    expert_ids int32 [len(sorted_token_ids) // B], num_tokens_post_padded (int).
    """
    if expert_map is not None:
        topk_ids = remap_to_local(topk_ids, expert_map)
    flat = np.asarray(topk_ids).reshape(-1)
    numel = flat.shape[0]
    B = block_size
    capacity = -(-(numel + num_experts * (B - 1)) // B) * B
    sorted_token_ids = np.full(capacity, numel, dtype=np.int32)
    expert_ids = np.full(capacity // B, -1, dtype=np.int32)
    position = 0
    for e in range(num_experts):
        indices = np.nonzero(flat == e)[0]
        if indices.size == 0:
            continue
        padded = -(-indices.size // B) * B
        sorted_token_ids[position : position + indices.size] = indices
        expert_ids[position // B : (position + padded) // B] = e
        position += padded
    return sorted_token_ids, expert_ids, position


def sort_by_expert(topk_ids, num_experts):
    """Stable sort of the flat (token, slot) entries by expert.

    Returns
    -------
    sorted_slots : int32 [M] flat indices ``t*K' + k`` in expert order, ascending within an expert
    expert_offsets : int32 [num_experts + 1], expert e owns rows [offsets[e], offsets[e+1])
    inverse_index : int32 [T, K'], the row of each entry, -1 for ids outside [0, num_experts)
    """
    ids = np.asarray(topk_ids)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    candidates = np.nonzero(valid)[0]
    sorted_slots = candidates[np.argsort(flat[candidates], kind="stable")].astype(np.int32)
    counts = np.bincount(flat[valid], minlength=num_experts)[:num_experts]
    expert_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    inverse = np.full(flat.shape[0], -1, dtype=np.int32)
    inverse[sorted_slots] = np.arange(sorted_slots.shape[0], dtype=np.int32)
    return sorted_slots, expert_offsets, inverse.reshape(ids.shape)


def permute(hidden_states, topk_ids, num_experts):
    """Gather token rows into expert-sorted order.

    Returns permuted_hidden [M, H] (dtype of hidden_states), expert_offsets int32
    [num_experts + 1] and inverse_index int32 [T, K'] (see ``sort_by_expert``).
    """
    hidden_states = np.asarray(hidden_states)
    top_k = np.asarray(topk_ids).shape[1]
    sorted_slots, expert_offsets, inverse_index = sort_by_expert(topk_ids, num_experts)
    return hidden_states[sorted_slots // top_k], expert_offsets, inverse_index


def combine(expert_out, inverse_index, topk_weights=None):
    """``out[t] = sum_k w[t, k] * expert_out[inverse_index[t, k]]`` over entries >= 0.

    Accumulates in float32 and returns the dtype of ``expert_out``; weights None means 1.
    expert_out [M, H]; inverse_index int32 [T, K']; topk_weights float32 [T, K'].
    """
    expert_out = np.asarray(expert_out)
    inverse_index = np.asarray(inverse_index)
    T, K = inverse_index.shape
    weights = np.ones((T, K), np.float32) if topk_weights is None else np.asarray(topk_weights, np.float32)
    out = np.zeros((T, expert_out.shape[1]), dtype=np.float32)
    for k in range(K):
        rows = inverse_index[:, k]
        valid = rows >= 0
        out[valid] += weights[valid, k, None] * expert_out[rows[valid]].astype(np.float32)
    return out.astype(expert_out.dtype)
