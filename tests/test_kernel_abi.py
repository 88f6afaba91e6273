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


def test_tensor_maps_encoded_once_per_tensor_and_declaration(monkeypatch):
    """The launcher encodes a TMA descriptor once per (declaration, address, shape, strides, dtype):
    the same tensor again takes the stored bytes; another view, dtype or declaration encodes anew;
    the store is emptied when full."""
    import struct
    from dataclasses import dataclass

    from epilora_cute import launcher
    from epilora_cute.kernel_abi import TensorMapParam

    calls = []

    @dataclass(frozen=True)
    class FakeTma(TensorMapParam):
        box: tuple = (64, 8)

        def pack(self, t):
            calls.append(t)
            return struct.pack("<QQQ", t.data_ptr(), t.shape[0], t.stride(0)) + bytes(104)

    monkeypatch.setattr(launcher, "_TENSORMAPS", {})
    p, q = FakeTma("tma_a"), FakeTma("tma_a", box=(64, 16))
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    first = launcher._tensormap(p, w)
    assert launcher._tensormap(p, w) == first == p.pack(w) and len(calls) == 2  # (the second: p.pack above)
    assert launcher._tensormap(p, w[:32]) != first  # another shape: its own descriptor
    assert launcher._tensormap(p, w[32:]) != first  # another address
    assert launcher._tensormap(p, w.view(torch.int16)) == first and len(calls) == 5  # another dtype: encoded anew
    launcher._tensormap(q, w)  # another declaration (box)
    assert len(calls) == 6 and len(launcher._TENSORMAPS) == 5
    monkeypatch.setattr(launcher, "_TENSORMAPS_MAX", 5)
    launcher._tensormap(p, w[:16])  # full: emptied first
    assert len(launcher._TENSORMAPS) == 1 and len(calls) == 7


def _written(p, v) -> bytes:
    from epilora_cute import launcher

    buf = bytearray(8 + p.size + 8)
    launcher._writer(p)(buf, 8, v)
    assert buf[:8] == bytes(8) and buf[8 + p.size:] == bytes(8)  # nothing outside the slot
    return bytes(buf[8:8 + p.size])


def test_writers_write_exactly_what_pack_returns():
    """The launcher's hot path writes each parameter in place (kernel_abi writers); the bytes must
    be pack()'s, for every kind of declaration, and bad values must fail as pack() fails."""
    from kernels_dsl._abi import CoordParam

    base = torch.empty(6, 40, dtype=torch.bfloat16)
    cases = [
        (TensorParam("x", torch.bfloat16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,)), base[:, :32]),
        (TensorParam("y", torch.float32, 2, dynamic_shape=(0,), dynamic_stride=(0,), align=4), torch.empty(5, 7)),
        (TensorParam("s", torch.float32, 2, dynamic_shape=(0,), align=4), torch.empty(9, 1)),
        (TensorParam("h", torch.float32, 3, dynamic_shape=(1,), dynamic_stride=(0,)), torch.empty(3, 11, 64)),
        (TensorParam("v", torch.int32, 1, align=4), torch.empty(2, dtype=torch.int32)),
        (ScalarParam("n", "i"), -7), (ScalarParam("q", "q"), 1 << 40), (ScalarParam("f", "f"), 0.5),
        (CoordParam("dims", 2), (4096, 6144)), (CoordParam("rows", 1), (8,)),
        (TensorMapParam("tma"), bytes(range(128))),
    ]
    for p, v in cases:
        assert _written(p, v) == p.pack(v), p.name
    x = cases[0][0]
    with pytest.raises(TypeError, match="bfloat16"):
        _written(x, torch.empty(2, 8))
    with pytest.raises(ValueError, match="2-D"):
        _written(x, torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="aligned"):
        _written(x, torch.empty(2, 9, dtype=torch.bfloat16)[:, 1:])
    with pytest.raises(ValueError, match="int32"):
        _written(x, torch.empty(2**31, 0, dtype=torch.bfloat16).t().t())
    with pytest.raises(ValueError):
        _written(CoordParam("dims", 2), (0, 5))
    with pytest.raises(ValueError):
        _written(CoordParam("dims", 2), (5,))
    with pytest.raises(ValueError):
        _written(TensorMapParam("tma"), bytes(64))


def test_kernel_call_packs_every_parameter_at_its_offset(monkeypatch):
    """Kernel.__call__'s parameter buffer, read at the launch: each slot holds pack(arg) at its
    aligned offset, and the pointer array points at the slots (the driver copies from there)."""
    import ctypes
    import types

    from epilora_cute import launcher

    params = [TensorParam("a", torch.bfloat16, 2, (0, 1), (0,)), TensorMapParam("t"), ScalarParam("n", "i"),
              TensorParam("s", torch.float32, 2, (0,), align=4)]
    art = types.SimpleNamespace(param_sizes=[24, 128, 4, 16], kernel_name="kern", family="fake")
    k = launcher.Kernel(art, params, (128, 1, 1))
    seen = []
    real = launcher._driver()

    def launch(cfg, fn, ptrs, extra):
        arr = ctypes.cast(ptrs, ctypes.POINTER(ctypes.c_void_p))
        seen.append([ctypes.string_at(arr[i], p.size) for i, p in enumerate(params)])
        return (real.CUresult.CUDA_SUCCESS,)

    drv = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    drv.cuLaunchKernelEx = launch
    monkeypatch.setattr(launcher, "_driver", lambda: drv)
    monkeypatch.setattr(launcher.Kernel, "_load", lambda self: (0, launcher._Loaded(None, None)))
    monkeypatch.setattr(launcher.Kernel, "_ensure_attrs", lambda self, *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    for i in range(3):  # the buffer is reused: every call rewrites every slot
        args = [torch.empty(3 + i, 16, dtype=torch.bfloat16), bytes([i]) * 128, 5 - i, torch.empty(7 + i, 1)]
        k(*args, grid=(1, 1, 1))
        assert seen[-1] == [p.pack(a) for p, a in zip(params, args)]
