"""Framework bindings: the torch adapter (`moeroute.bindings.torch`) and expert
parallelism on torch.distributed (`moeroute.bindings.ep`).

``import moeroute`` never imports this package, so it never pulls in torch. Importing either
submodule runs this package first, which loads the expert-parallel dispatchers: they
register themselves as the torch module's default (`MoE(ep_group=...)`), so the torch
module never imports the layer built on top of it.
"""

from moeroute.bindings import ep  # noqa: F401  (registers the EP dispatcher factory)
