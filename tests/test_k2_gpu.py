"""GPU correctness of the decode path: shrink(+quant) then K2 (PDL dependent), vs the reference.

Needs an sm_90 GPU. Launches through epilora_cute.kernels / epilora_cute.launcher (cached cubins,
no DSL needed at run time). Cluster launches (split-K > 1) need the launcher's `cluster=` support;
without it only split 1 runs and the rest is skipped with that reason.

At 1..8 tokens the decode path's default pairs the shrink without quantization planes with the
self-quantizing K2 (x_q only in K2's smem); the quantization-planes pairing is tested there too.

What is checked: x_q/s_x bit-exact against reference.quantize_fp8_per_token (the shrink's planes;
the self-quantizing K2's codes through an identity weight, where y = bf16(code * s_x) exactly); h against
reference.lora_shrink for tokens with an adapter; y against reference.lora_linear (bf16 output,
bf16 h in the epilogue WGMMA); outputs are poisoned (NaN) before each call and must be fully
written; 10 repeated calls give identical bits; the sync counters are back to zero after a call;
the TMA descriptors our specs encode equal the bytes the DSL's own host code builds.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from epilora_cute.metadata import build_meta
from epilora_cute.reference import lora_linear, lora_shrink, quantize_fp8_per_tensor, quantize_fp8_per_token
from kernels_dsl import k2_gemm, lora_shrink as shrink_mod

pytestmark = pytest.mark.gpu
WIDE = pytest.mark.decode_wide  # the decode pair at 33..64 tokens (K2's token tiles)

DATA = Path(__file__).resolve().parent / "data" / "k2_tma_golden.json"


def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")


def _kernel(mod, cfg):
    from epilora_cute.kernels import get_kernel

    return get_kernel(mod, cfg, "sm_90a")


def _launch(kernel, spec, pdl=None):
    kw = dict(grid=spec["grid"], smem=spec["smem"], pdl=spec["pdl"] if pdl is None else pdl)
    if "cluster" in inspect.signature(kernel.__call__).parameters:
        kw["cluster"] = spec["cluster"]
    elif spec["cluster"] != (1, 1, 1):
        pytest.skip("epilora_cute.launcher.Kernel has no cluster= support yet (split-K > 1 needs it)")
    kernel(*spec["args"], **kw)


def init_projection(obj, widths, K, rank, max_loras, M, seed, slot_ranks, dev) -> None:
    """The weights and adapters of one random projection, set on `obj` (shared by the decode-path
    and prefill-K2 GPU tests): FP8 W with its scale, per-slice A/B in vLLM's layout zeroed beyond
    each slot's effective rank, slot ranks and slice starts."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    obj.widths, obj.K, obj.rank, obj.L, obj.M = widths, K, rank, max_loras, M
    w = torch.randn(sum(widths), K, generator=g) * 0.02
    obj.w_codes, obj.w_scale = [t.to(dev) for t in quantize_fp8_per_tensor(w)]
    obj.slot_ranks_list = slot_ranks or [rank] * max_loras
    obj.lora_a, obj.lora_b = [], []
    for wd in widths:
        a = torch.randn(max_loras, 1, rank, K, generator=g) * 0.02
        b = torch.randn(max_loras, 1, wd, rank, generator=g) * 0.02
        for l, r in enumerate(obj.slot_ranks_list):
            a[l, :, r:] = 0
            b[l, :, :, r:] = 0
        obj.lora_a.append(a.to(torch.bfloat16).to(dev))
        obj.lora_b.append(b.to(torch.bfloat16).to(dev))
    obj.slot_ranks = torch.tensor(obj.slot_ranks_list, dtype=torch.int32, device=dev)
    obj.slice_start = torch.tensor([0] + list(torch.tensor(widths).cumsum(0).tolist()), dtype=torch.int32,
                                   device=dev)


class DecodePath:
    """Buffers + the two launches of one projection. self_quant (default): at 1..8 tokens the
    decode_sq pairing (k2_gemm.self_quant_applies), else the quantization planes (path "decode").
    fused: the one launch of path "decode_fh" (K2 computing h too; 1..8 tokens)."""

    def __init__(self, widths, K, rank, max_loras, M, seed=0, slot_ranks=None, dev="cuda", self_quant=True,
                 fused=False, push=None, wide=None):
        init_projection(self, widths, K, rank, max_loras, M, seed, slot_ranks, dev)
        self.push = push  # K2's push variants (k2_gemm.push_variant): None = EPILORA_K2_PUSH, "" = none
        # the wide self_quant builds (k2_gemm.sq_wide_applies): None = EPILORA_K2_SQ_WIDE, "always" = the
        # wide twin of the default build whatever the split
        self.wide = wide
        self.self_quant = self_quant and k2_gemm.self_quant_applies(M, K)
        self.fused = fused
        if fused:
            assert self.self_quant, "decode_fh takes 1..8 tokens"
            self.f_cfg, _ = k2_gemm.select(widths, M, rank, fused_h=True)
            self.partials = torch.empty(k2_gemm.fused_h_workspace_shape(self.f_cfg, K), dtype=torch.float32,
                                        device=dev)
        N = sum(widths)
        self.h = torch.empty(len(widths), M, rank, dtype=torch.float32, device=dev)
        self.x_q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
        self.x_scale = torch.empty(M, dtype=torch.float32, device=dev)
        self.sync = torch.zeros(2, dtype=torch.int32, device=dev)
        self.y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        self.dev = dev

    def run(self, x, tok, pdl=True, split_k2=None, split_shrink=None, poison=True):
        M, K, N = self.M, self.K, sum(self.widths)
        meta = build_meta(tok.to(self.dev), self.L)
        if poison:
            self.y.fill_(float("nan"))
            self.h.fill_(float("nan"))
            self.x_q.view(torch.uint8).fill_(0x7F)
            self.x_scale.fill_(float("nan"))
        if self.fused:
            return self._run_fused(x, meta, pdl, split_k2, poison)
        sq = self.self_quant
        s_cfg = shrink_mod.select(len(self.widths), M, self.rank, quant=not sq)
        groups = min(M, self.L + 1)
        ss = split_shrink or shrink_mod.choose_split(K, len(self.widths), self.rank, groups)
        common = dict(token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                      num_active=meta.num_active, slot_ranks=self.slot_ranks)
        xs = {} if sq else dict(x_q=self.x_q, x_scale=self.x_scale, sync=self.sync)
        sspec = shrink_mod.launch(s_cfg, x=x, lora_a=self.lora_a, h=self.h, split=ss, **xs, **common)
        forced = self.wide == "always"  # the wide twin at any split it can run (tests/test_k2_wide_gpu.py)
        k_cfg, _ = k2_gemm.select(self.widths, M, self.rank, self_quant=sq, push=self.push, k=K,
                                  wide=False if forced else self.wide)
        if forced:
            k_cfg = k2_gemm.wide_config(k_cfg)
            assert k_cfg is not None, "no wide build for this projection"
        self.k_cfg = k_cfg
        # (a self-quantizing K2 needs split >= min_split: a forced smaller one is raised to it)
        sk = max(split_k2, k2_gemm.min_split(k_cfg, K, M)) if split_k2 else k2_gemm.split_for(k_cfg, N, K, M)
        if sq:
            xs = dict(x=x)
        else:
            xs = dict(xs, n_quant=sspec["n_quant"])
        kspec = k2_gemm.launch(k_cfg, w_q=self.w_codes, w_scale=self.w_scale, y=self.y, split=sk, h=self.h,
                               slice_start=self.slice_start, lora_b=self.lora_b, **xs, **common)
        _launch(_kernel(shrink_mod, s_cfg), sspec)
        _launch(_kernel(k2_gemm, k_cfg), kspec, pdl=pdl)
        return self.y

    def _run_fused(self, x, meta, pdl, split_k2, poison):
        M, K, N = self.M, self.K, sum(self.widths)
        cfg = self.f_cfg
        if poison:  # partials past an effective rank are never written, and must never be read
            self.partials.fill_(float("nan"))
        sk = max(split_k2, k2_gemm.min_split(cfg, K)) if split_k2 else k2_gemm.split_for(cfg, N, K)
        spec = k2_gemm.launch(cfg, w_q=self.w_codes, w_scale=self.w_scale, y=self.y, split=sk, x=x, sync=self.sync,
                              h=self.partials, token_lora=meta.token_lora_mapping[:M],
                              active_lora_ids=meta.active_lora_ids, num_active=meta.num_active,
                              slot_ranks=self.slot_ranks, slice_start=self.slice_start, lora_b=self.lora_b,
                              lora_a=self.lora_a)
        _launch(_kernel(k2_gemm, cfg), spec, pdl=pdl)
        return self.y

    def check(self, x, tok, y):
        # The fp32 reference of y runs on the GPU (same torch code, fp32 without TF32): the CPU
        # references of the 72B shapes dominated this file's time on the H200 host.
        assert not torch.backends.cuda.matmul.allow_tf32
        ref = lora_linear(x, self.w_codes, self.w_scale, self.lora_a, self.lora_b, tok.to(x.device))
        if not self.self_quant:  # (the self-quantizing K2 keeps x_q in smem: test_self_quant_codes)
            xq_ref, sx_ref = quantize_fp8_per_token(x.cpu())
            assert torch.equal(self.x_q.cpu().view(torch.uint8), xq_ref.view(torch.uint8)), "x_q differs"
            assert torch.equal(self.x_scale.cpu(), sx_ref.reshape(-1)), "s_x differs"
        href = lora_shrink(x.cpu(), [a.cpu() for a in self.lora_a], tok.cpu())
        if self.fused:  # (h exists only as partials in K2's workspace)
            href = []
        # h is the decode path's own buffer: the shrink writes, for a token's slot, the 64-row rank
        # chunks below the slot's effective rank (K2 reads nothing else); the rest stays as it was.
        for j, slot in enumerate(tok.cpu().tolist()):
            if slot < 0:
                continue
            cols = min(self.rank, -(-max(min(self.slot_ranks_list[slot], self.rank), 0) // 64) * 64)
            for s in range(len(href)):
                torch.testing.assert_close(self.h[s, j, :cols].cpu(), href[s][j, :cols], rtol=1e-4, atol=1e-4)
        assert not torch.isnan(y).any(), "y not fully written"
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
        assert self.sync.cpu().tolist() == [0, 0], "sync counters not re-armed"


def _tokens(M, n_adapters, seed, none_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, max(n_adapters, 1), (M,), generator=g)
    none = torch.rand(M, generator=g) < none_frac
    return torch.where(none, torch.full_like(slots, -1), slots).to(torch.int32)


def _x(M, K, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16).cuda()


SHAPES = k2_gemm.projection_shapes()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-tp{s[1]}-{s[2]}")
@pytest.mark.parametrize("M", [1, 7, 32, pytest.param(40, marks=WIDE), pytest.param(64, marks=WIDE)])
def test_decode_path_model_shapes(shape, M):
    _hopper()
    _, _, _, widths, K = shape
    dp = DecodePath(widths, K, 64, 4, M, seed=M)
    x, tok = _x(M, K, M), _tokens(M, 3, M)
    dp.check(x, tok, dp.run(x, tok))


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8, 16, 31, 32, pytest.param(33, marks=WIDE), pytest.param(48, marks=WIDE),
                               pytest.param(64, marks=WIDE)])
@pytest.mark.parametrize("rank", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("pdl", [True, False])
def test_decode_path_tokens_ranks(M, rank, pdl):
    _hopper()
    widths, K = (4096, 1024, 1024), 4096  # Qwen3-8B qkv
    dp = DecodePath(widths, K, rank, 8, M, seed=rank + M)
    x, tok = _x(M, K, rank * 100 + M), _tokens(M, min(8, M), rank + M)
    dp.check(x, tok, dp.run(x, tok, pdl=pdl))


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] == "qwen3-8b" and s[1] == 1], ids=lambda s: s[2])
def test_quant_planes_pairing_small_batches(shape, M, pdl):
    """1..8 tokens with the quantization in the shrink kernel (path "decode")."""
    _hopper()
    _, _, _, widths, K = shape
    dp = DecodePath(widths, K, 64, 4, M, seed=M + 40, self_quant=False)
    x, tok = _x(M, K, M + 40), _tokens(M, 3, M + 40)
    dp.check(x, tok, dp.run(x, tok, pdl=pdl))


def _special_rows(M, K, seed):
    """Random rows, plus (when M allows) a zero row, one with a single huge value among tiny
    ones, and one of values far below the scale floor."""
    x = _x(M, K, seed).float()
    if M > 1:
        x[1] = 0
    if M > 2:
        x[2] = torch.randn(K, device=x.device) * 1e-3
        x[2, K // 3] = 3.0e4
    if M > 3:
        x[3] = torch.randn(K, device=x.device) * 1e-9
    if M > 4:  # every finite bf16 magnitude, random signs, the largest last (exercises every quotient)
        mags = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        idx = torch.linspace(0, mags.numel() - 1, K).long()
        sign = torch.where(torch.rand(K) < 0.5, -1.0, 1.0)
        x[4] = (mags[idx] * sign).to(x.device)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("K", [4096, 12288])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("split", [None, 16])
@pytest.mark.parametrize("rowmax", [False, True])
def test_self_quant_codes_bit_exact(K, M, lora, split, rowmax):
    """The self-quantizing K2's codes and scales, read back through an identity weight (e4m3 1.0
    on the diagonal, s_w = 1): y[j, n] = bf16(code[j, n] * s_x[j]), bit for bit against the
    reference quantization (every code of every token; the scale to bf16 resolution, any error in
    the row maximum changes codes). Tokens without adapter: the epilogue adds nothing. rowmax: the
    sq_rowmax builds (maxima over the whole rows where M * K <= ROWMAX_ELEMS, else the exchange)."""
    _hopper()
    dev = "cuda"
    x = _special_rows(M, K, K + M)
    xq_ref, sx_ref = quantize_fp8_per_token(x.cpu())
    # A code of -0 (0x80) comes out as +0: the tensor cores' sum of -0 with the +0 products of the
    # other weights is +0 (so no GEMM result ever depends on the sign of a zero code).
    want = (xq_ref.float() * sx_ref.reshape(-1, 1)).to(torch.bfloat16) + 0.0
    w = torch.eye(K, dtype=torch.float32).to(torch.float8_e4m3fn).to(dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    y = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=dev)
    # (sq_rowmax builds have no push variant: under EPILORA_K2_PUSH their base is the default build)
    lcfg, ncfg = k2_gemm.select((K,), M, 64, self_quant=True, push="" if rowmax else None)
    cfg = lcfg if lora else ncfg
    if rowmax:
        cfg = dataclasses.replace(cfg, sq_rowmax=True)
        assert cfg in k2_gemm.rowmax_configs()
    sk = split or k2_gemm.split_for(cfg, K, K)
    if lora:
        dp = DecodePath((K,), K, 64, 2, M, seed=1, self_quant=True)
        tok = torch.full((M,), -1, dtype=torch.int32)
        meta = build_meta(tok.to(dev), 2)
        dp.h.zero_()
        spec = k2_gemm.launch(cfg, w_q=w, w_scale=one, x=x, y=y, split=sk, h=dp.h,
                              token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                              num_active=meta.num_active, slot_ranks=dp.slot_ranks, slice_start=dp.slice_start,
                              lora_b=dp.lora_b)
    else:
        spec = k2_gemm.launch(cfg, w_q=w, w_scale=one, x=x, y=y, split=sk)
    _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
    got = y.cpu()
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} codes differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("split", [1, 2, 3, 5, 8])
def test_split_k_values(split):
    _hopper()
    widths, K = (14336, 14336), 4096  # Llama-3.1-8B gate/up
    dp = DecodePath(widths, K, 16, 4, 9, seed=split)
    x, tok = _x(9, K, split), _tokens(9, 4, split)
    dp.check(x, tok, dp.run(x, tok, split_k2=split, split_shrink=min(split, 4)))


def test_mixed_effective_ranks_and_no_adapter_tokens():
    _hopper()
    widths, K = (4096, 1024, 1024), 4096
    sr = [128, 8, 64, 16, 0, 100, 128, 33]
    dp = DecodePath(widths, K, 128, 8, 24, seed=5, slot_ranks=sr)
    x = _x(24, K, 5)
    tok = torch.tensor([-1, 4, 1, 2, 3, 5, 6, 7, 0, -1] + [i % 8 for i in range(14)], dtype=torch.int32)
    dp.check(x, tok, dp.run(x, tok))


@pytest.mark.parametrize("self_quant,M", [(True, 5), (False, 5), pytest.param(False, 50, marks=WIDE)])
def test_all_tokens_without_adapter(self_quant, M):
    _hopper()
    widths, K = (4096,), 4096
    dp = DecodePath(widths, K, 64, 4, M, seed=9, self_quant=self_quant)
    x, tok = _x(M, K, 9), torch.full((M,), -1, dtype=torch.int32)
    dp.check(x, tok, dp.run(x, tok))


@WIDE
@pytest.mark.parametrize("M", [33, 57, 64])
def test_token_tiles_many_adapters_mixed_ranks(M):
    """33..64 tokens (two token tiles per weight block): 8 adapters of mixed effective ranks with
    tokens without adapter in both tiles, an adapter group straddling the tiles' boundary; bitwise
    identical over 10 runs, with and without PDL."""
    _hopper()
    widths, K = (4096, 1024, 1024), 4096
    sr = [128, 8, 64, 16, 0, 100, 128, 33]
    dp = DecodePath(widths, K, 128, 8, M, seed=M, slot_ranks=sr)
    x = _x(M, K, M)
    tok = _tokens(M, 8, M, none_frac=0.2)
    tok[30:36] = 3  # one group on both sides of token 32
    tok[0], tok[M - 1] = -1, 5
    first = dp.run(x, tok).clone()
    dp.check(x, tok, first)
    assert dp.k_cfg.token_tiles
    for pdl in [True] * 9 + [False]:
        assert torch.equal(dp.run(x, tok, pdl=pdl).view(torch.int16), first.view(torch.int16))


def test_bitwise_identical_over_10_runs():
    _hopper()
    widths, K = (12288, 12288), 4096  # Qwen3-8B gate/up
    dp = DecodePath(widths, K, 64, 8, 16, seed=1)
    x, tok = _x(16, K, 1), _tokens(16, 8, 1)
    first = dp.run(x, tok).clone()
    dp.check(x, tok, first)
    for _ in range(9):
        assert torch.equal(dp.run(x, tok).view(torch.int16), first.view(torch.int16))


@WIDE
@pytest.mark.parametrize("split", [1, 3])
def test_token_tiles_are_the_one_tile_kernel_on_each_half(split):
    """At 64 tokens each token tile computes exactly what the one-tile bn 32 build computes for its
    32 tokens alone (same weights, same splits): y's halves bit for bit, h's rows too."""
    _hopper()
    widths, K = (12288, 12288), 4096  # Qwen3-8B gate/up
    x, tok = _x(64, K, 77), _tokens(64, 4, 77)
    tok[31:34] = 2  # a group across the boundary
    both = DecodePath(widths, K, 64, 4, 64, seed=7)
    y = both.run(x, tok, split_k2=split, split_shrink=2).clone()
    assert both.k_cfg.token_tiles
    for t in range(2):
        half = DecodePath(widths, K, 64, 4, 32, seed=7)
        rows = slice(32 * t, 32 * t + 32)
        yh = half.run(x[rows].contiguous(), tok[rows].clone(), split_k2=split, split_shrink=2)
        assert not half.k_cfg.token_tiles
        assert torch.equal(yh.view(torch.int16), y[rows].view(torch.int16)), f"token tile {t} differs"
        has = (tok[rows] >= 0).cuda()
        assert torch.equal(half.h[:, has], both.h[:, rows][:, has]), f"h of token tile {t} differs"


@pytest.mark.parametrize("M", [8, pytest.param(40, marks=WIDE)])
def test_no_adapter_variant(M):
    _hopper()
    K, N = 4096, 4096
    dp = DecodePath((N,), K, 16, 2, M, seed=3)
    x = _x(M, K, 3)
    xq, sx = quantize_fp8_per_token(x)
    dp.x_q.copy_(xq)
    dp.x_scale.copy_(sx.reshape(-1))
    _, cfg = k2_gemm.select((N,), M)
    spec = k2_gemm.launch(cfg, w_q=dp.w_codes, w_scale=dp.w_scale, x_q=dp.x_q, x_scale=dp.x_scale, y=dp.y,
                          sync=dp.sync, n_quant=0, split=k2_gemm.split_for(cfg, N, K, M))
    dp.y.fill_(float("nan"))
    _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
    ref = (xq.float() * sx) @ (dp.w_codes.float() * dp.w_scale).t()
    torch.testing.assert_close(dp.y.float(), ref, rtol=1e-2, atol=1e-2)


# --- decode_fh: K2 computing h itself (one launch) -------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-tp{s[1]}-{s[2]}")
@pytest.mark.parametrize("M", [1, 7])
def test_fused_h_model_shapes(shape, M):
    _hopper()
    _, _, _, widths, K = shape
    if not k2_gemm.self_quant_applies(M, K):
        pytest.skip(f"decode_fh does not take K = {K} (not a multiple of 128)")
    dp = DecodePath(widths, K, 64, 4, M, seed=M + 7, fused=True)
    x, tok = _x(M, K, M + 7), _tokens(M, 3, M + 7)
    dp.check(x, tok, dp.run(x, tok))


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("rank", [8, 16, 64, 128, 256])
def test_fused_h_tokens_ranks(M, rank):
    _hopper()
    widths, K = (4096, 1024, 1024), 4096  # Qwen3-8B qkv
    dp = DecodePath(widths, K, rank, 8, M, seed=rank + M + 3, fused=True)
    x, tok = _x(M, K, rank * 100 + M + 3), _tokens(M, min(8, M), rank + M + 3)
    dp.check(x, tok, dp.run(x, tok, pdl=M % 2 == 0))


@pytest.mark.parametrize("widths,K", [((12288, 12288), 4096), ((4096,), 12288), ((29568 // 2, 29568 // 2), 8192)],
                         ids=["gate_up", "down", "72b-tp2-gate_up"])
@pytest.mark.parametrize("fused", [True, False], ids=["fh", "sq"])
def test_fused_h_many_adapters_many_units(widths, K, fused):
    """8 tokens of 8 rank-256 adapters: more units than producing CTAs (each takes several); the
    same case on the decode_sq pair for comparison."""
    _hopper()
    dp = DecodePath(widths, K, 256, 8, 8, seed=11, fused=fused)
    x, tok = _x(8, K, 11), torch.arange(8, dtype=torch.int32)
    dp.check(x, tok, dp.run(x, tok))


def test_fused_h_mixed_effective_ranks_and_no_adapter_tokens():
    _hopper()
    widths, K = (4096, 1024, 1024), 4096
    sr = [128, 8, 64, 16, 0, 100, 128, 33]
    dp = DecodePath(widths, K, 128, 8, 8, seed=5, slot_ranks=sr, fused=True)
    x = _x(8, K, 5)
    tok = torch.tensor([-1, 4, 1, 2, 5, 7, 1, -1], dtype=torch.int32)
    dp.check(x, tok, dp.run(x, tok))


@pytest.mark.parametrize("split", [2, 3, 5, 8, 16])
def test_fused_h_split_k_values(split):
    _hopper()
    widths, K = (14336, 14336), 4096  # Llama-3.1-8B gate/up
    dp = DecodePath(widths, K, 16, 4, 5, seed=split, fused=True)
    x, tok = _x(5, K, split), _tokens(5, 4, split)
    dp.check(x, tok, dp.run(x, tok, split_k2=split))


def test_fused_h_all_tokens_without_adapter_and_bitwise_repeats():
    _hopper()
    widths, K = (12288, 12288), 4096
    dp = DecodePath(widths, K, 64, 4, 5, seed=9, fused=True)
    x, tok = _x(5, K, 9), torch.full((5,), -1, dtype=torch.int32)
    dp.check(x, tok, dp.run(x, tok))
    x, tok = _x(8, K, 10), _tokens(8, 4, 10)
    dp = DecodePath(widths, K, 64, 4, 8, seed=10, fused=True)
    first = dp.run(x, tok).clone()
    dp.check(x, tok, first)
    for _ in range(9):
        assert torch.equal(dp.run(x, tok).view(torch.int16), first.view(torch.int16))
        assert dp.sync.cpu().tolist() == [0, 0]


# (byte, bit) of the descriptor set by the DSL's packer and not reachable through the driver API.
_DSL_ONLY_BITS = ((8, 1), (10, 5))


def _unmask(desc: bytes) -> bytes:
    b = bytearray(desc)
    for byte, bit in _DSL_ONLY_BITS:
        b[byte] &= ~(1 << bit) & 0xFF
    return bytes(b)


def test_tma_descriptors_match_dsl_host_code():
    """Our cuTensorMapEncodeTiled(spec) bytes == the DSL host code's (captured on a CPU machine by
    tests/data/make_k2_golden.py). On mismatch, report which L2-promotion / OOB-fill would match.

    Two bits the DSL's own packer sets (byte 8 bit 1, byte 10 bit 5; seen on the H200 for every
    descriptor) have no cuTensorMapEncodeTiled input that produces them (every L2-promotion and
    OOB-fill choice was tried): they are masked. Addresses, dims, strides, boxes, swizzle,
    L2 promotion and fill must agree."""
    _hopper()
    from kernels_dsl._abi import encode_tensormap

    if not DATA.exists():
        pytest.skip(f"no golden data at {DATA}")
    golden = json.loads(DATA.read_text())
    torch.zeros(1, device="cuda")  # the driver API encoder needs torch's context to be current
    report = []
    for entry in golden["descriptors"]:
        mod = k2_gemm if entry["family"] == k2_gemm.FAMILY else shrink_mod
        cfg = mod.Config(**entry["config"])
        spec = {p.name: p for p in mod.params(cfg)}[entry["param"]].spec
        rows, cols = entry["rows"], entry["cols"]
        # Only the numbers matter to the encoder: a stand-in with the golden shape, strides and
        # address (no allocation: the golden tensors can be large).
        want = bytes.fromhex(entry["dsl_bytes"])[:64]
        itemsize = torch.empty(0, dtype=spec.torch_dtype).element_size()
        strides = (entry["row_stride"], 1)

        class _View:
            shape, dtype = torch.Size((rows, cols)), spec.torch_dtype

            def dim(self):
                return 2

            def stride(self, i):
                return strides[i]

            def element_size(self):
                return itemsize

            def data_ptr(self):
                return entry["address"]

        got = encode_tensormap(_View(), spec)[:64]
        if _unmask(got) != _unmask(want):
            alts = []
            for l2 in ("NONE", "L2_64B", "L2_128B", "L2_256B"):
                for oob in ("NONE", "NAN_REQUEST_ZERO_FMA"):
                    try:  # NaN fill is refused for some dtypes (fp8): not a candidate then
                        if encode_tensormap(_View(), spec, l2, oob)[:64] == want:
                            alts.append((l2, oob))
                    except RuntimeError:
                        pass
            report.append(dict(param=entry["param"], config=entry["config"], got=got.hex(), want=want.hex(),
                               matching_l2_oob=alts))
    assert not report, json.dumps(report, indent=1)
