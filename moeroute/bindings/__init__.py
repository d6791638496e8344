"""Framework bindings: the torch adapter (`moeroute.bindings.torch`) and expert
parallelism on torch.distributed (`moeroute.bindings.ep`). Import the submodules
directly; this package imports nothing so ``import moeroute`` never pulls in torch."""
