"""The torch adapter: the MoE module, zero-copy tensor exchange, dispatchers, transformers interop.

    from moeroute.bindings.torch import MoE, replace_moe_blocks

`MoE` is the layer (docs/semantics.md section 8); `replace_moe_blocks` swaps every supported
transformers MoE block of a model for it; `load_experts` fills the layers from a
safetensors checkpoint one tensor at a time (FP8 experts stay FP8). The dispatcher interface that expert
parallelism implements is in `moeroute.bindings.torch.dispatch`.
"""

from moeroute.routing.threads import start_threads

# Numba's workers start before any kernel runs, and torch keeps the thread count it was given
# (the two share one OpenMP runtime; see moeroute.routing.threads).
start_threads()

from moeroute.bindings.torch.checkpoint import load_experts
from moeroute.bindings.torch.dispatch import DispatchHandle, Dispatcher, LocalDispatcher
from moeroute.bindings.torch.hf import (
    SUPPORTED_BLOCKS,
    experts_forward,
    from_hf,
    register_experts_implementation,
    replace_moe_blocks,
)
from moeroute.bindings.torch.int4_keys import Int4Checkpoint
from moeroute.bindings.torch.mlp import GatedMLP
from moeroute.bindings.torch.moe import MoE

__all__ = [
    "MoE",
    "GatedMLP",
    "load_experts",
    "Int4Checkpoint",
    "replace_moe_blocks",
    "register_experts_implementation",
    "experts_forward",
    "from_hf",
    "SUPPORTED_BLOCKS",
    "Dispatcher",
    "DispatchHandle",
    "LocalDispatcher",
]
