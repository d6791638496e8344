"""moeroute: Mixture-of-Experts routing, expert layouts and token dispatch for inference engines.

Data flows one way: ``RouterConfig`` -> ``ExpertLayout`` -> routing (``select_experts``,
``append_shared_slots``, ``align_block_size``, ``route`` fusing the first ones, ...) -> dispatch -> expert GEMMs -> combine.
Every routing op takes NumPy arrays, torch tensors (CPU or CUDA), CuPy arrays and numba
device arrays and answers in the caller's framework. The torch module lives in
``moeroute.bindings.torch`` and vLLM-shaped entry points in ``moeroute.compat.vllm``; both
are imported on demand.
"""

from moeroute.config import PRESETS, ModelPreset, RouterConfig, get_preset
from moeroute.cpu_features import cpu_isa  # decides the CPU path before any kernel is defined
from moeroute.layout import ExpertLayout, LayoutError
from moeroute.routing import (
    align_block_size,
    append_shared_slots,
    combine,
    expert_load,
    logical_to_physical,
    permute,
    remap_to_local,
    route,
    select_experts,
    sort_by_expert,
)
from moeroute.runtime import warmup

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ExpertLayout",
    "LayoutError",
    "ModelPreset",
    "RouterConfig",
    "align_block_size",
    "append_shared_slots",
    "combine",
    "cpu_isa",
    "expert_load",
    "get_preset",
    "logical_to_physical",
    "permute",
    "remap_to_local",
    "route",
    "select_experts",
    "sort_by_expert",
    "warmup",
]
