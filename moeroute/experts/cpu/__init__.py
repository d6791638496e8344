"""The expert compute's Numba CPU kernels (see `moeroute.experts`)."""
