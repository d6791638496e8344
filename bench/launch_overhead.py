"""Host cost per call of preparing a routing kernel's arguments: cached launcher vs numba.

Runs without a GPU. What is timed, per call of two kernels: select_experts' (8 arguments:
logits, bias, two outputs, four scalars) and the fused route's (20 arguments: 9 arrays, 11
scalars), with the signature the op states, and route's once more with its signature read
from the arguments on each call (``signature_of``, as the other ops' launches do):

* ``cached pack``: the cached launcher's whole per-call argument work (routing/_launcher.py):
  the kernel's lookup (``cached_kernel``), for the last row ``signature_of``, then
  ``make_packer``'s reading pointer, shape and strides from each array and flattening
  numba's kernel ABI into the list CuPy launches with. Arrays are CPU torch tensors (the
  same attribute reads as CUDA tensors) and NumPy-backed CuPy-like objects.
* ``numba typing``: what numba-cuda's dispatcher does first on every call and can do here:
  typing each argument (``dispatcher.typeof_pyval``) on objects exposing
  ``__cuda_array_interface__``, as torch and CuPy arrays do. The rest of numba's per-call
  path (wrapping foreign arrays, ``_prepare_args``' ctypes values, the cuda.core launch)
  needs a device and is NOT in this figure: the numba column is a lower bound of numba's
  cost, so the ratio understates the saving. bench/gpu_routing.py measures whole launches
  on a GPU.

Neither column includes CuPy's own marshalling of the list (Cython) or the driver launch.

    python bench/launch_overhead.py [--repeats 200] [--calls 200]

Writes bench/results/launch_overhead.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import calls_per_sample, interleaved, print_table, write_results  # noqa: E402

NUM_TOKENS = (1, 8, 64)  # decode sizes; the argument work does not depend on T
NUM_EXPERTS, TOP_K = 256, 8  # DeepSeek-V3 routing


class ArrayInterface:
    """A NumPy array seen only through ``__cuda_array_interface__`` (what numba types)."""

    def __init__(self, array):
        self._interface = {
            "shape": array.shape,
            "strides": None,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "version": 3,
        }

    @property
    def __cuda_array_interface__(self):
        return self._interface


class CupyLike:
    """The attributes the cached launcher reads from a CuPy array, over NumPy memory."""

    class _Pointer:
        def __init__(self, ptr):
            self.ptr = ptr

    class _Flags:
        def __init__(self, array):
            self.c_contiguous = array.flags.c_contiguous
            self.f_contiguous = array.flags.f_contiguous

    def __init__(self, array):
        self.data = self._Pointer(array.ctypes.data)
        self.shape, self.strides, self.itemsize = array.shape, array.strides, array.itemsize
        self.dtype, self.ndim, self.flags = array.dtype, array.ndim, self._Flags(array)


def route_arguments(num_tokens, wrap):
    """The fused route kernel's arguments for a DeepSeek-V3 router on 8 ranks."""
    from moeroute.layout import ExpertLayout

    layout = ExpertLayout(NUM_EXPERTS, 1, ep_size=8, dispatch="all2all")
    select = arguments(num_tokens, wrap)
    width = TOP_K + 1
    tables = (wrap(np.array(t)) for t in (layout.replica_offsets, layout.replica_ids, layout.routed_id_map))
    outputs = (wrap(np.zeros((num_tokens, width), np.float32)), wrap(np.zeros((num_tokens, width), np.int32)))
    return (
        *select[:6],
        NUM_EXPERTS,
        *tables,
        int(layout.shared_slot_ids(3)[0]),
        1,
        outputs[0],
        0,
        0,
        np.float32(1.0),
        False,
        wrap(np.ascontiguousarray(layout.expert_map(3), np.int32)),
        *outputs,
    )


def arguments(num_tokens, wrap):
    rng = np.random.default_rng(num_tokens)
    logits = rng.standard_normal((num_tokens, NUM_EXPERTS)).astype(np.float32)
    bias = rng.standard_normal(NUM_EXPERTS).astype(np.float32)
    out_w = np.zeros((num_tokens, TOP_K), np.float32)
    out_ids = np.zeros((num_tokens, TOP_K), np.int32)
    return (wrap(logits), wrap(bias), num_tokens, TOP_K, 4, np.float32(2.5), wrap(out_w), wrap(out_ids))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed samples per figure")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    args = parser.parse_args(argv)

    import torch
    from numba import cuda

    from moeroute.routing import _launcher
    from moeroute.routing import select as select_module

    from moeroute.routing.route import _route_kernel, _route_signature

    route_kernel = _route_kernel(NUM_EXPERTS, 8, "sigmoid", True, True, "float32")
    kernels = {  # name -> (dispatcher, fixed signature or None, arguments(T, wrap))
        "select_experts": (
            select_module._device_kernel(NUM_EXPERTS, 8, "sigmoid", True, True, "float32"),
            select_module._device_signature("float32"),
            arguments,
        ),
        "route": (route_kernel, _route_signature("float32", "C", "C"), route_arguments),
        "route, signature_of": (route_kernel, None, route_arguments),
    }
    wrappers = {"torch": torch.from_numpy, "cupy-like": CupyLike}

    rows = []
    for name, (dispatcher, fixed, build) in kernels.items():
        assert isinstance(dispatcher, cuda.dispatcher.CUDADispatcher)
        typeof = dispatcher.typeof_pyval
        for num_tokens in NUM_TOKENS:
            numba_args = build(num_tokens, ArrayInterface)
            signature = tuple(typeof(a) for a in numba_args)
            assert fixed is None or signature == tuple(fixed)

            def numba_typing(numba_args=numba_args, typeof=typeof):
                return [typeof(a) for a in numba_args]

            for framework, wrap in wrappers.items():
                cached_args = build(num_tokens, wrap)
                assert _launcher.signature_of(cached_args) == signature
                pack = _launcher.make_packer(signature)
                assert len(pack(cached_args)) == len(_launcher.parameter_types(signature))
                if fixed is None:  # launch(): type, find the kernel of that signature, pack

                    def cached(a=cached_args, d=dispatcher):
                        return _launcher.cached_kernel(d, _launcher.signature_of(a)).pack(a)
                else:  # launch(): find the kernel of the op's signature, pack

                    def cached(a=cached_args, d=dispatcher, fixed=fixed):
                        return _launcher.cached_kernel(d, fixed).pack(a)

                result = interleaved(
                    calls_per_sample(numba_typing, args.calls), calls_per_sample(cached, args.calls), args.repeats
                )
                rows.append(
                    {
                        "kernel": name,
                        "num_tokens": num_tokens,
                        "arrays": framework,
                        "arguments": len(cached_args),
                        "signature": "read from the arguments" if fixed is None else "fixed",
                        "numba_typing_us_per_call": result["baseline_us"] / args.calls,
                        "cached_pack_us_per_call": result["candidate_us"] / args.calls,
                        "ratio": result["speedup"],
                        "ratio_range": result["speedup_range"],
                        "repeats": args.repeats,
                        "calls_per_sample": args.calls,
                    }
                )
    print_table(
        ["kernel", "T", "arrays", "numba typing us/call", "cached pack us/call", "ratio"],
        [
            [
                r["kernel"],
                r["num_tokens"],
                r["arrays"],
                r["numba_typing_us_per_call"],
                r["cached_pack_us_per_call"],
                r["ratio"],
            ]
            for r in rows
        ],
    )
    path = write_results(
        "launch_overhead",
        {
            "kernels": {
                "select_experts": "8 arguments: 4 arrays (logits, bias, two outputs), 4 "
                "scalars; signature fixed by the op",
                "route": "20 arguments: 9 arrays, 11 scalars; signature fixed by the op",
                "route, signature_of": "the same, its signature read from the arguments "
                "on each call (signature_of, as the other ops do)",
            },
            "measured": (
                "host microseconds per call of argument preparation only, no GPU: "
                "cached = the launcher's whole packing; numba = argument typing only "
                "(typeof_pyval on __cuda_array_interface__ objects), a lower bound of "
                "numba's per-call cost; neither includes the driver launch"
            ),
            "results": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
