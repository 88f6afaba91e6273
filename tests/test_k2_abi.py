"""Decode-path kernels' run-time contract, checked without a GPU or the DSL.

* the golden TMA descriptors (the DSL host code's own bytes, tests/data/k2_tma_golden.json)
  decode to exactly what our TmaSpecs declare (dims, row stride, box, swizzle, dtype);
* launch() builds one argument per declared parameter and every non-TMA argument packs;
* the launch geometry and smem of every prebuild configuration are sane.
"""

import json
from pathlib import Path

import pytest
import torch

from epilora_cute.metadata import build_meta
from kernels_dsl import k2_gemm, lora_shrink
from kernels_dsl._abi import TmaParam
from kernels_dsl.host_capture import DSL_DTYPE_CODE, SWIZZLE_CODE, decode_tensormap2d

GOLDEN = Path(__file__).resolve().parent / "data" / "k2_tma_golden.json"


def test_golden_descriptors_decode_to_declared_specs():
    golden = json.loads(GOLDEN.read_text())
    assert len(golden["descriptors"]) >= 10
    for e in golden["descriptors"]:
        mod = k2_gemm if e["family"] == k2_gemm.FAMILY else lora_shrink
        cfg = mod.Config(**e["config"])
        spec = {p.name: p for p in mod.params(cfg)}[e["param"]].spec
        d = decode_tensormap2d(e["dsl_bytes"])
        es = torch.empty(0, dtype=spec.torch_dtype).element_size()
        assert d["address"] == e["address"], e["param"]
        assert d["dims"] == (e["cols"], e["rows"]), (e["param"], d)
        assert d["box"] == tuple(spec.box), (e["param"], d)
        assert d["stride1_bytes"] == e["row_stride"] * es, (e["param"], d)
        assert d["swizzle_code"] == SWIZZLE_CODE[spec.swizzle], (e["param"], d)
        assert d["dtype_code"] == DSL_DTYPE_CODE[spec.tma_dtype], (e["param"], d)


def _pack_non_tma(params, args):
    out = []
    for p, a in zip(params, args):
        if isinstance(p, TmaParam):
            assert isinstance(a, torch.Tensor) and a.dim() == 2 and a.dtype == p.spec.torch_dtype, p.name
            assert a.stride(1) == 1 and (a.stride(0) * a.element_size()) % 16 == 0, p.name
            out.append(None)
        else:
            b = p.pack(a)
            assert len(b) == p.size, p.name
            out.append(b)
    return out


def _batch(M, widths, K, rank, L=4):
    """CPU stand-ins of one projection's decode-path inputs: metadata (tokens dealt over L slots
    and "no adapter"), A/B buffers, h, x and full slot ranks."""
    tok = torch.tensor([(i % (L + 1)) - 1 for i in range(M)], dtype=torch.int32)
    meta = build_meta(tok, L)
    lora_a = [torch.zeros(L, 1, rank, K, dtype=torch.bfloat16) for _ in widths]
    lora_b = [torch.zeros(L, 1, wd, rank, dtype=torch.bfloat16) for wd in widths]
    h = torch.zeros(len(widths), M, rank)
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    sr = torch.full((L,), rank, dtype=torch.int32)
    return meta, lora_a, lora_b, h, x, sr


@pytest.mark.parametrize("M,widths,K,rank", [(1, (4096, 1024, 1024), 4096, 64), (17, (14784, 14784), 8192, 16),
                                             (32, (8192,), 29568, 256), (33, (14784, 14784), 8192, 16),
                                             (48, (4096, 1024, 1024), 4096, 64), (64, (8192,), 29568, 256)])
def test_launch_builds_packable_arguments(M, widths, K, rank):
    L = 4
    N = sum(widths)
    meta, lora_a, lora_b, h, x, sr = _batch(M, widths, K, rank, L)
    x_q = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
    sx = torch.zeros(M)
    sync = torch.zeros(2, dtype=torch.int32)
    s_cfg = lora_shrink.select(len(widths), M, rank)
    sspec = lora_shrink.launch(s_cfg, x=x, lora_a=lora_a, h=h, x_q=x_q, x_scale=sx, sync=sync,
                               token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                               num_active=meta.num_active, slot_ranks=sr, split=4)
    assert len(sspec["args"]) == len(lora_shrink.params(s_cfg))
    _pack_non_tma(lora_shrink.params(s_cfg), sspec["args"])
    per_plane = 4 * len(widths) * -(-rank // 64)
    zq = -(-M // per_plane)  # quantization planes: one token per CTA
    assert sspec["grid"] == (4, len(widths) * -(-rank // 64), zq + min(M, L + 1))
    assert sspec["n_quant"] == zq * per_plane and not sspec["pdl"]

    k_cfg, n_cfg = k2_gemm.select(widths, M, rank)
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    y = torch.zeros(M, N, dtype=torch.bfloat16)
    ss = torch.tensor([0] + torch.tensor(widths).cumsum(0).tolist(), dtype=torch.int32)
    split = k2_gemm.choose_split(N, K, k_cfg.bm)
    kspec = k2_gemm.launch(k_cfg, w_q=w, w_scale=torch.ones(1), x_q=x_q, x_scale=sx, y=y, sync=sync,
                           n_quant=sspec["n_quant"], split=split, h=h, token_lora=meta.token_lora_mapping[:M],
                           active_lora_ids=meta.active_lora_ids, num_active=meta.num_active, slot_ranks=sr,
                           slice_start=ss, lora_b=lora_b)
    assert len(kspec["args"]) == len(k2_gemm.params(k_cfg))
    _pack_non_tma(k2_gemm.params(k_cfg), kspec["args"])
    tiles = 1 if M <= 32 else 2  # 33..64 tokens: two token tiles per weight block (grid y)
    assert k_cfg.token_tiles == n_cfg.token_tiles == (M > 32)
    assert kspec["grid"] == (split, N // k_cfg.bm * tiles, 1) and kspec["cluster"] == (split, 1, 1) and kspec["pdl"]
    nspec = k2_gemm.launch(n_cfg, w_q=w, w_scale=torch.ones(1), x_q=x_q, x_scale=sx, y=y, sync=sync, n_quant=0,
                           split=split)
    assert len(nspec["args"]) == len(k2_gemm.params(n_cfg)) and not nspec["pdl"]


def test_token_tile_builds_for_33_to_64_tokens():
    """33..64 tokens: K2's bn 32 builds with token tiles (x_q given; not self-quantizing) beside the
    shrink's 64-token tile; beyond 64, or with a one-tile build, a clear error."""
    widths = (4096, 1024, 1024)
    for m in (33, 40, 63, 64):
        k_cfg, n_cfg = k2_gemm.select(widths, m, 64)
        for c in (k_cfg, n_cfg):
            assert c.token_tiles and c.bn == 32 and not c.self_quant and c.name().endswith("_tt")
            assert k2_gemm.token_tiles_of(c, m) == 2
        s_cfg = lora_shrink.select(len(widths), m, 64)
        assert s_cfg.bn == 64 and s_cfg.stages == lora_shrink.WIDE_STAGES
        # An SM running a shrink CTA still takes one of K2's CTAs beside it (the 6 stages' reason).
        assert s_cfg.smem_bytes() + k_cfg.smem_bytes() + 2 * 1024 <= k2_gemm.SMEM_PER_SM
    for m in (1, 8, 9, 32):
        assert not any(c.token_tiles for c in k2_gemm.select(widths, m, 64))
        assert lora_shrink.select(len(widths), m, 64).bn == k2_gemm.token_tile(m)
    assert k2_gemm.token_tiles_of(k2_gemm.select(widths, 33, 64)[0], 32) == 1
    with pytest.raises(ValueError, match="1..64"):
        k2_gemm.select(widths, 65, 64)
    with pytest.raises(ValueError, match="1..64"):
        lora_shrink.select(3, 65, 64)
    with pytest.raises(ValueError, match="self-quantizing"):
        k2_gemm.select(widths, 33, 64, self_quant=True)
    for bad in (dict(bn=16), dict(bn=16, self_quant=True), dict(bn=32, trace=True), dict(bn=32, early=1)):
        with pytest.raises(ValueError, match="token_tiles"):
            k2_gemm.Config(token_tiles=True, **bad)
    # Launch limits: a one-tile build takes its tile, a token-tile build 1..64.
    L, K, N = 4, 4096, sum(widths)
    w, y65 = torch.zeros(N, K, dtype=torch.float8_e4m3fn), torch.zeros(65, N, dtype=torch.bfloat16)
    xq65, sx65, sync = torch.zeros(65, K, dtype=torch.float8_e4m3fn), torch.zeros(65), torch.zeros(2, dtype=torch.int32)
    one_tile = k2_gemm.select(widths, 32, None)[1]
    with pytest.raises(ValueError, match="1..32"):
        k2_gemm.launch(one_tile, w_q=w, w_scale=torch.ones(1), x_q=xq65[:33], x_scale=sx65[:33], y=y65[:33],
                       sync=sync, split=1)
    tt = k2_gemm.select(widths, 64, None)[1]
    with pytest.raises(ValueError, match="1..64"):
        k2_gemm.launch(tt, w_q=w, w_scale=torch.ones(1), x_q=xq65, x_scale=sx65, y=y65, sync=sync, split=1)
    # Twice the CTAs per weight block: the split model sees twice the tiles (never a larger split).
    for _, _, _, ws, k in k2_gemm.projection_shapes():
        c1, c2 = k2_gemm.select(ws, 32, 64)[0], k2_gemm.select(ws, 64, 64)[0]
        n = sum(ws)
        assert k2_gemm.split_for(c2, n, k, 64) == k2_gemm.choose_split(2 * n, k, c2.bm, c2.bk, ctas_per_sm=c2.ctas)
        assert k2_gemm.split_for(c2, n, k, 64) <= k2_gemm.split_for(c1, n, k, 32)
        assert k2_gemm.split_for(c2, n, k, 33) == k2_gemm.split_for(c2, n, k, 64)


def test_prebuild_geometry():
    for cfg in k2_gemm.prebuild_configs():
        assert cfg.smem_bytes() <= 227 * 1024 and cfg.block == (256, 1, 1)
    for cfg in lora_shrink.prebuild_configs():
        assert cfg.smem_bytes() <= 227 * 1024 and cfg.block == (128, 1, 1)
    names = [c.name() for c in k2_gemm.prebuild_configs()] + [c.name() for c in lora_shrink.prebuild_configs()]
    assert len(names) == len(set(names))
    # Every SM streams weights: narrow projections are split so that the CTAs cover the GPU.
    for _, _, _, widths, k in k2_gemm.projection_shapes():
        bm = k2_gemm.bm_for(widths)
        tiles, s = sum(widths) // bm, k2_gemm.choose_split(sum(widths), k, bm)
        assert 1 <= s <= 8 and -(-k // 128) // s >= 2
        # at least 80 CTAs (an SM streams at most ~1.6x its fair share of the bandwidth)
        assert tiles * s >= 80 or s == 8
        assert k2_gemm.choose_split(sum(widths), k, bm, ctas_per_sm=1) <= 2


@pytest.mark.parametrize("M,widths,K,rank", [(1, (4096, 1024, 1024), 4096, 64), (8, (4096,), 12288, 16),
                                             (3, (7168, 7168), 4096, 256)])
def test_self_quant_pairing_arguments(M, widths, K, rank):
    """1..8 tokens: the shrink without quantization planes (no x_q / s_x / sync) and the
    self-quantizing K2 (bf16 x, no counter), every CTA with at most sq_kblocks k-blocks."""
    assert k2_gemm.self_quant_applies(M, K)
    L, N = 4, sum(widths)
    meta, lora_a, lora_b, h, x, sr = _batch(M, widths, K, rank, L)
    common = dict(token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                  num_active=meta.num_active, slot_ranks=sr)
    s_cfg = lora_shrink.select(len(widths), M, rank, quant=False)
    sspec = lora_shrink.launch(s_cfg, x=x, lora_a=lora_a, h=h, split=4, **common)
    assert len(sspec["args"]) == len(lora_shrink.params(s_cfg))
    _pack_non_tma(lora_shrink.params(s_cfg), sspec["args"])
    assert sspec["grid"] == (4, len(widths) * -(-rank // 64), min(M, L + 1)) and sspec["n_quant"] == 0

    k_cfg, n_cfg = k2_gemm.select(widths, M, rank, self_quant=True)
    assert k_cfg.self_quant and n_cfg.self_quant and k_cfg.fits_ctas() and n_cfg.fits_ctas()
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    y = torch.zeros(M, N, dtype=torch.bfloat16)
    ss = torch.tensor([0] + torch.tensor(widths).cumsum(0).tolist(), dtype=torch.int32)
    for cfg, kw in ((k_cfg, dict(h=h, slice_start=ss, lora_b=lora_b, **common)), (n_cfg, {})):
        split = k2_gemm.split_for(cfg, N, K)
        assert -(-(-(-K // 128)) // split) <= cfg.sq_kblocks and split <= 16
        spec = k2_gemm.launch(cfg, w_q=w, w_scale=torch.ones(1), x=x, y=y, split=split, **kw)
        assert len(spec["args"]) == len(k2_gemm.params(cfg))
        _pack_non_tma(k2_gemm.params(cfg), spec["args"])
        assert spec["grid"] == (split, N // cfg.bm, 1) and spec["pdl"] == cfg.lora
        with pytest.raises(ValueError, match="k-blocks"):
            k2_gemm.launch(cfg, w_q=w, w_scale=torch.ones(1), x=x, y=y, split=k2_gemm.min_split(cfg, K) - 1, **kw)
        with pytest.raises(ValueError, match="takes x"):
            k2_gemm.launch(cfg, w_q=w, w_scale=torch.ones(1), x_q=x.to(torch.float8_e4m3fn), y=y, split=split, **kw)


def test_self_quant_applies():
    assert k2_gemm.self_quant_applies(1, 4096) and k2_gemm.self_quant_applies(8, 29568 // 128 * 128)
    assert not k2_gemm.self_quant_applies(9, 4096)  # 16-token tiles: the quantization planes
    assert not k2_gemm.self_quant_applies(1, 14784)  # K not a multiple of 128
    assert not k2_gemm.self_quant_applies(1, 128 * 16 * 16 + 128)  # more than 16 x 16 k-blocks


def test_shrink_split_fills_the_gpu_up_to_small_split():
    """The decode shrink's split (docs/perf.md v0.48): half the SMs as before, or up to
    SMALL_SPLIT splits when the grid (every possible adapter group) still fits the whole GPU."""
    from kernels_dsl import lora_shrink as S

    def splits(slices, k):
        return [S.choose_split(k, slices, 64, min(m, 9)) for m in (1, 2, 4, 8, 16, 32)]

    assert splits(3, 4096) == [8, 8, 5, 4, 4, 4]  # qkv: 2 at >= 8 tokens before
    assert splits(2, 4096) == [8, 8, 8, 4, 4, 4]  # gate_up: 3 at >= 9 tokens before
    assert splits(1, 4096) == [8, 8, 8, 8, 7, 7]  # o: unchanged
    assert splits(1, 12288) == [8, 8, 8, 8, 7, 7]  # down: unchanged
    for slices, groups in ((3, 9), (2, 9), (1, 9), (3, 33)):
        s = S.choose_split(4096, slices, 64, groups)
        assert slices * groups * s <= 132 or s == 1  # never more than one wave of shrink CTAs
    assert S.choose_split(128, 1, 64, 1) == 1  # >= 2 k-blocks per split


def test_push_variants_keep_the_abi_and_the_geometry():
    """The push variants (EPILORA_K2_PUSH) take the same parameters and launch geometry as the
    default build they vary; select() applies them only where they are prebuilt."""
    import dataclasses
    import os

    from kernels_dsl import k2_gemm

    pre = set(k2_gemm.prebuild_configs())
    for c in k2_gemm.push_configs():
        base = dataclasses.replace(c, push_maxima=False, push_partials=False)
        assert base in pre and c in pre
        assert [(p.name, p.size) for p in k2_gemm.params(c)] == [(p.name, p.size) for p in k2_gemm.params(base)]
        assert c.fits_ctas() and c.smem_bytes() >= base.smem_bytes()
        assert c.name() != base.name()
    widths = (4096, 1024, 1024)
    assert k2_gemm.select(widths, 1, 64, self_quant=True, push="none") == k2_gemm.select(widths, 1, 64, self_quant=True, push="")
    lq, nq = k2_gemm.select(widths, 1, 64, self_quant=True, push="maxima,partials")
    assert lq.push_maxima and lq.push_partials and nq.push_maxima and nq.push_partials
    l, n = k2_gemm.select(widths, 20, 64, push="maxima")
    assert not (l.push_maxima or l.push_partials or n.push_maxima)  # maxima: self_quant builds only
    l, n = k2_gemm.select(widths, 20, 16, push="partials")
    assert not l.push_partials and n.push_partials  # rank 16 has no prebuilt push build
    assert k2_gemm.select(widths, 1, 64, fused_h=True, push="partials")[0].push_partials is False
    old = os.environ.get(k2_gemm.PUSH_ENV)
    try:
        os.environ.pop(k2_gemm.PUSH_ENV, None)  # unset: the default, both pushes
        assert k2_gemm.push_flags() == ("maxima", "partials") and k2_gemm.select(widths, 1, 64, self_quant=True)[0].push_maxima
        for off in ("", "none", " None "):
            os.environ[k2_gemm.PUSH_ENV] = off
            assert k2_gemm.push_flags() == () and not k2_gemm.select(widths, 20, 64)[0].push_partials
        os.environ[k2_gemm.PUSH_ENV] = "partials"
        assert k2_gemm.select(widths, 20, 64)[0].push_partials
        os.environ[k2_gemm.PUSH_ENV] = "bogus"
        with pytest.raises(ValueError):
            k2_gemm.select(widths, 20, 64)
    finally:
        if old is None:
            os.environ.pop(k2_gemm.PUSH_ENV, None)
        else:
            os.environ[k2_gemm.PUSH_ENV] = old
    with pytest.raises(ValueError):
        k2_gemm.Config(bn=8, lora=False, push_maxima=True)  # not self_quant


def test_wide_self_quant_builds_split_and_abi(monkeypatch):
    """The wide self-quantizing builds (Config.sq_xblocks, EPILORA_K2_SQ_WIDE; docs/perf.md v0.54):
    the same parameters and grid rule as the default build they widen; chosen only where they
    lower the split (gate_up at 1..4 tokens, down at 1..6); the launch holds every CTA to the
    register bound min(M, bn) x k-blocks <= 128."""
    import dataclasses

    pre = set(k2_gemm.prebuild_configs())
    assert k2_gemm.wide_configs() and set(k2_gemm.wide_configs()) <= pre
    for w in k2_gemm.wide_configs():
        base = k2_gemm.default_config(w.bn, w.bm, **k2_gemm._kw(w), self_quant=True)
        base = dataclasses.replace(base, push_maxima=w.push_maxima, push_partials=w.push_partials)
        assert base in pre and k2_gemm.wide_config(base) == w
        assert [(p.name, p.size) for p in k2_gemm.params(w)] == [(p.name, p.size) for p in k2_gemm.params(base)]
        assert w.fits_ctas() and w.ctas == 2 and w.sq_kblocks == k2_gemm.SQ_WIDE_KBLOCKS
        assert w.name().endswith("_x32")
    with pytest.raises(ValueError, match="sq_xblocks"):
        k2_gemm.Config(bn=8, lora=False, sq_xblocks=32)  # not self_quant
    with pytest.raises(ValueError, match="sq_xblocks"):
        k2_gemm.Config(bn=8, lora=False, self_quant=True, sq_xblocks=64)
    # The register bound: 128 k-block rows per CTA.
    w = k2_gemm.default_config(8, 128, lora=False, self_quant=True, sq_xblocks=32)
    d = k2_gemm.default_config(8, 128, lora=False, self_quant=True)
    assert [k2_gemm.min_split(w, 4096, m) for m in (1, 4, 5, 8)] == [1, 1, 2, 2]
    assert [k2_gemm.min_split(d, 4096, m) for m in (1, 4, 8)] == [2, 2, 2]
    assert k2_gemm.min_split(w, 4096) == 2  # m unknown: a full tile
    # Selection: on unless turned off (run20); then only where the split drops.
    gate_up, down, qkv = (12288, 12288), (4096,), (4096, 1024, 1024)
    monkeypatch.delenv(k2_gemm.SQ_WIDE_ENV, raising=False)
    assert k2_gemm.SQ_WIDE_DEFAULT == "1" and k2_gemm.sq_wide_enabled()
    assert k2_gemm.select(gate_up, 1, 64, self_quant=True, k=4096)[0].sq_xblocks
    for off in ("0", "off", ""):
        monkeypatch.setenv(k2_gemm.SQ_WIDE_ENV, off)
        assert not k2_gemm.select(gate_up, 1, 64, self_quant=True, k=4096)[0].sq_xblocks
    monkeypatch.setenv(k2_gemm.SQ_WIDE_ENV, "1")
    for widths, k, ms in ((gate_up, 4096, (1, 2, 3, 4)), (down, 12288, (1, 2, 3, 4, 5, 6))):
        for m in range(1, 9):
            lw, nw = k2_gemm.select(widths, m, 64, self_quant=True, k=k)
            ld, _ = k2_gemm.select(widths, m, 64, self_quant=True)
            assert bool(lw.sq_xblocks) == (m in ms), (widths, m)
            n = sum(widths)
            if m in ms:
                assert k2_gemm.split_for(lw, n, k, m) < k2_gemm.split_for(ld, n, k, m)
                assert lw.push_maxima == ld.push_maxima and lw.push_partials == ld.push_partials
                assert lw in pre and nw in pre
    assert not k2_gemm.select(qkv, 1, 64, self_quant=True, k=4096)[0].sq_xblocks  # qkv: split 2 either way
    assert not k2_gemm.select(gate_up, 1, 16, self_quant=True, k=4096)[0].sq_xblocks  # rank 16: none built
    assert not k2_gemm.select(gate_up, 1, 64, self_quant=True)[0].sq_xblocks  # K unknown
    assert not k2_gemm.select(gate_up, 1, 64, self_quant=True, k=4096, wide=False)[0].sq_xblocks
    monkeypatch.setenv(k2_gemm.SQ_WIDE_ENV, "maybe")
    with pytest.raises(ValueError, match=k2_gemm.SQ_WIDE_ENV):
        k2_gemm.select(gate_up, 1, 64, self_quant=True, k=4096)
    # The launch checks the bound with the batch's M.
    M, K = 5, 4096
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    y = torch.zeros(M, 4096, dtype=torch.bfloat16)
    wq = torch.zeros(4096, K, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k-blocks"):
        k2_gemm.launch(w, w_q=wq, w_scale=torch.ones(1), x=x, y=y, split=1)
    spec = k2_gemm.launch(w, w_q=wq, w_scale=torch.ones(1), x=x[:4], y=y[:4], split=1)
    assert spec["grid"] == (1, 32, 1) and spec["smem"] == w.smem_bytes()


def test_xgate_pair_arguments():
    """v1.03: the x-gated shrink takes the gate (int32 [2]) after h, the x-gated K2 after y, with
    the gate's count as n_quant; both refuse to launch without it, and only self_quant adapter builds
    (and the shrink without quantization planes) have an x-gated twin."""
    M, widths, K, rank, L = 1, (4096, 1024, 1024), 4096, 64, 4
    N = sum(widths)
    meta, lora_a, lora_b, h, x, sr = _batch(M, widths, K, rank, L)
    common = dict(token_lora=meta.token_lora_mapping[:M], active_lora_ids=meta.active_lora_ids,
                  num_active=meta.num_active, slot_ranks=sr)
    gate = torch.zeros(4, dtype=torch.int32)[2:]
    s_cfg = lora_shrink.xgate_variant(lora_shrink.select(len(widths), M, rank, quant=False))
    sspec = lora_shrink.launch(s_cfg, x=x, lora_a=lora_a, h=h, split=4, sync=gate, **common)
    names = [p.name for p in lora_shrink.params(s_cfg)]
    assert len(sspec["args"]) == len(names) and sspec["args"][names.index("sync")] is gate
    assert names.index("sync") == names.index("h") + 1 and sspec["n_gate"] == lora_shrink.XGATE_COUNT
    _pack_non_tma(lora_shrink.params(s_cfg), sspec["args"])
    with pytest.raises(ValueError, match="gate"):
        lora_shrink.launch(s_cfg, x=x, lora_a=lora_a, h=h, split=4, **common)

    plain, _ = k2_gemm.select(widths, M, rank, self_quant=True)
    k_cfg = k2_gemm.xgate_variant(plain)
    assert k_cfg.name() == plain.name() + "_xg" and k_cfg.smem_bytes() == plain.smem_bytes()
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    y = torch.zeros(M, N, dtype=torch.bfloat16)
    ss = torch.tensor([0] + torch.tensor(widths).cumsum(0).tolist(), dtype=torch.int32)
    kw = dict(w_q=w, w_scale=torch.ones(1), x=x, y=y, split=k2_gemm.split_for(k_cfg, N, K), h=h, slice_start=ss,
              lora_b=lora_b, **common)
    spec = k2_gemm.launch(k_cfg, sync=gate, n_quant=sspec["n_gate"], **kw)
    names = [p.name for p in k2_gemm.params(k_cfg)]
    assert len(spec["args"]) == len(names) and spec["args"][names.index("sync")] is gate
    assert names.index("sync") == names.index("y") + 1 and spec["args"][names.index("n_quant")] == 1
    assert spec["pdl"] and spec["grid"] == k2_gemm.launch(plain, **kw)["grid"]
    _pack_non_tma(k2_gemm.params(k_cfg), spec["args"])
    with pytest.raises(ValueError, match="sync"):
        k2_gemm.launch(k_cfg, **kw)
    with pytest.raises(ValueError, match="n_quant"):
        k2_gemm.launch(k_cfg, sync=gate, n_quant=0, **kw)
    _, no_adapter = k2_gemm.select(widths, M, rank, self_quant=True)
    assert k2_gemm.xgate_variant(no_adapter) is None
    assert k2_gemm.xgate_variant(k2_gemm.select(widths, M, 16, self_quant=True)[0]) is None  # rank 16: not built
    assert lora_shrink.xgate_variant(lora_shrink.select(len(widths), M, rank)) is None  # quantization planes
