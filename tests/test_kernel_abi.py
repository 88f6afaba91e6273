"""The by-value parameter ABI: packing and the PTX signature reader (CPU)."""

import struct

import pytest
import torch

from epilora_cute.kernel_abi import ScalarParam, TensorMapParam, TensorParam, check_params, ptx_entries


def test_tensor_param_layout_matches_dsl_struct():
    # {ptr; int32 M, K; int64 row stride} -> 24 bytes, as the DSL emits for a [M, K] tensor.
    p = TensorParam("x", torch.bfloat16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,))
    t = torch.empty(3, 40, dtype=torch.bfloat16)[:, :32]
    blob = p.pack(t)
    assert len(blob) == p.size == 24
    ptr, m, k, s0 = struct.unpack("<Qiiq", blob)
    assert (ptr, m, k, s0) == (t.data_ptr(), 3, 32, 40)
    # One dynamic shape, one stride: padding before the int64.
    p2 = TensorParam("y", torch.float32, 2, dynamic_shape=(0,), dynamic_stride=(0,), align=4)
    assert p2.size == 24 and struct.unpack("<Qi4xq", p2.pack(torch.empty(5, 7)))[1:] == (5, 7)
    assert TensorParam("s", torch.float32, 2, dynamic_shape=(0,), align=4).size == 16


def test_tensor_param_checks():
    p = TensorParam("x", torch.bfloat16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16)
    with pytest.raises(TypeError, match="bfloat16"):
        p.pack(torch.empty(2, 8))
    with pytest.raises(ValueError, match="2-D"):
        p.pack(torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="aligned"):
        p.pack(torch.empty(2, 9, dtype=torch.bfloat16)[:, 1:])


def test_scalars_and_tensor_maps():
    assert ScalarParam("n", "i").pack(7) == struct.pack("<i", 7)
    assert TensorMapParam("tma").size == 128
    with pytest.raises(ValueError):
        TensorMapParam("tma").pack(b"\0" * 64)


PTX = """
.visible .entry kern(
	.param .align 8 .b8 kern_param_0[24],
	.param .align 64 .b8 kern_param_1[128],
	.param .u32 kern_param_2,
	.param .align 8 .b8 kern_param_3[16]
)
.reqntid 256, 1, 1
{ ret; }
"""


def test_ptx_signature_reader_and_check():
    assert ptx_entries(PTX) == {"kern": [24, 128, 4, 16]}
    params = [TensorParam("a", torch.bfloat16, 2, (0, 1), (0,)), TensorMapParam("t"), ScalarParam("n", "i"),
              TensorParam("s", torch.float32, 2, (0,), align=4)]
    check_params(params, [24, 128, 4, 16], "kern")
    with pytest.raises(RuntimeError, match="do not match"):
        check_params(params[:3], [24, 128, 4, 16], "kern")
