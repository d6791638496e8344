"""Router configuration, model presets and reading Hugging Face configs.

Three rooms, one import path (``from moeroute.config import RouterConfig, PRESETS, ...``):

* `moeroute.config.configs`: `RouterConfig` (what `select_experts` needs to pick each
  token's experts, docs/semantics.md section 1) and `ModelPreset` (what the expert layout and
  the shared-expert plan need: the correction bias, the shared expert's shape and gate, the
  hidden and intermediate sizes), with their checks and the lists they check against.
* `moeroute.config.hf_readers`: reading a Hugging Face ``config.json`` (a dict, a path, or a
  transformers configuration object) per model family, behind ``from_hf``.
* `moeroute.config.presets`: `PRESETS`, the models of docs/semantics.md section 1 with their
  real sizes.

This package is the bottom of the stack: it imports neither torch nor transformers (a
transformers configuration is read through ``to_dict()``).
"""

from moeroute.config.configs import (  # noqa: F401  (the two constants outside __all__ too)
    EXPERT_ACTIVATIONS,
    MAX_NUM_EXPERTS,
    ROUTED_SCALING_FACTOR_RANGE,
    SCORING_FUNCTIONS,
    ModelPreset,
    RouterConfig,
)
from moeroute.config.hf_readers import SUPPORTED_MODEL_TYPES
from moeroute.config.hf_readers import _as_dict  # noqa: F401  (moeroute.quant.config reads it here)
from moeroute.config.presets import PRESETS, get_preset

__all__ = [
    "RouterConfig",
    "ModelPreset",
    "PRESETS",
    "get_preset",
    "SCORING_FUNCTIONS",
    "SUPPORTED_MODEL_TYPES",
    "ROUTED_SCALING_FACTOR_RANGE",
]
