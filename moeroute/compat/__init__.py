"""Entry points shaped like other engines' APIs, so that moeroute drops into their call sites.

from moeroute.compat.vllm import fused_topk, grouped_topk
"""
