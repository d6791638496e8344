"""moeroute.routing._float16: the one 16-bit decode table of the CPU kernels."""

import numpy as np
import torch

from moeroute.routing import _float16
from moeroute.routing.combine import _host as combine_host
from moeroute.routing.select import _host as select_host


def test_decode_tables_are_torchs_conversions():
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for bfloat16, dtype in ((False, torch.float16), (True, torch.bfloat16)):
        table = _float16.decode_table(bfloat16)
        assert table.dtype == np.float32 and table.shape == (1 << 16,)
        expected = bits.view(dtype).float().numpy()
        np.testing.assert_array_equal(table, expected)  # NaNs in the same places, every value exact


def test_select_and_combine_share_one_table_per_kind():
    assert select_host._HALF_TO_FLOAT is combine_host._decode_table(False) is _float16.decode_table(False)
    assert select_host._BF16_TO_FLOAT is combine_host._decode_table(True) is _float16.decode_table(True)


def test_one_list_of_ep_dispatch_modes():
    from moeroute.bindings import ep
    from moeroute.bindings.torch import moe
    from moeroute.layout import DISPATCH_MODES, EP_DISPATCH_MODES

    assert EP_DISPATCH_MODES == ("all2all", "allgather") and set(EP_DISPATCH_MODES) < set(DISPATCH_MODES)
    assert ep.EP_DISPATCH_MODES is EP_DISPATCH_MODES is moe.EP_DISPATCH_MODES
