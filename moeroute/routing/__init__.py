"""Routing and dispatch operations, each with a Numba CPU kernel and a numba.cuda kernel.

NumPy inputs run on the CPU and return NumPy arrays; device arrays (numba, CuPy, torch CUDA
tensors) run on the GPU and stay there. ``reference`` holds the plain NumPy definitions.
"""

from moeroute.routing import _cache

_cache.install()  # before any kernel is decorated: Numba picks its cache locator then

from moeroute.routing.align import align_block_size  # noqa: E402
from moeroute.routing.combine import combine  # noqa: E402
from moeroute.routing.load import expert_load  # noqa: E402
from moeroute.routing.permute import permute, sort_by_expert  # noqa: E402
from moeroute.routing.remap import logical_to_physical, remap_to_local  # noqa: E402
from moeroute.routing.route import route  # noqa: E402
from moeroute.routing.select import select_experts  # noqa: E402
from moeroute.routing.shared_slots import append_shared_slots  # noqa: E402

__all__ = [
    "align_block_size",
    "append_shared_slots",
    "combine",
    "expert_load",
    "logical_to_physical",
    "permute",
    "remap_to_local",
    "route",
    "select_experts",
    "sort_by_expert",
]
