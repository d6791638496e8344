"""moeroute.experts.activations: one list of names, their check and their compute."""

import math

import pytest
import torch

from moeroute.bindings.torch import hf
from moeroute.experts import activations
from moeroute.experts.formats import unquantized
from moeroute.compat import vllm_plugin
from moeroute.config import EXPERT_ACTIVATIONS
from moeroute.gpu import launch


def test_every_list_of_names_is_the_config_one():
    assert activations.ACTIVATIONS is EXPERT_ACTIVATIONS
    # The unquantized experts' module re-exports them (users import these names from it).
    for name in activations.__all__:
        assert getattr(unquantized, name) is getattr(activations, name)
    assert list(launch.ACTIVATIONS) == list(EXPERT_ACTIVATIONS)
    assert list(launch.ACTIVATIONS.values()) == [0, 1, 2, 3]  # kActivation* of moe_gemm.cu
    assert vllm_plugin.ACTIVATIONS == {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
    # transformers' spellings are its own; each maps to one of the names.
    assert set(hf._HF_ACTIVATIONS.values()) <= set(EXPERT_ACTIVATIONS)


@pytest.mark.parametrize("bad", ["relu", "SiLU", None, 1])
def test_check_activation_names_the_allowed_ones(bad):
    with pytest.raises(ValueError, match="activation=.*use one of"):
        activations.check_activation(bad)


@pytest.mark.parametrize("name", EXPERT_ACTIVATIONS)
def test_gated_activation_is_the_formula(name):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(64, generator=gen, dtype=torch.float64) * 6 for _ in range(2))

    def act(g, u):  # written from the definitions, per element
        if name == "silu":
            return g / (1 + math.exp(-g)) * u
        if name == "gelu":
            return 0.5 * g * (1 + math.erf(g / math.sqrt(2))) * u
        if name == "gelu_tanh":
            return 0.5 * g * (1 + math.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
        g = min(g, 7.0)
        return (min(max(u, -7.0), 7.0) + 1) * g / (1 + math.exp(-1.702 * g))

    expected = torch.tensor([act(g, u) for g, u in zip(gate.tolist(), up.tolist())], dtype=torch.float64)
    torch.testing.assert_close(activations.gated_activation(gate.clone(), up, name), expected)
