"""How many threads moeroute's parallel CPU kernels use: the routing kernels' rule, read by the
expert kernels and the torch bindings too (`moeroute.routing._parallel` says why torch's thread
count is the one to follow)."""

from moeroute.routing._parallel import cpu_threads, start_threads

__all__ = ["cpu_threads", "start_threads"]
