"""The torch adapter: the MoE module, zero-copy tensor exchange, dispatchers."""
