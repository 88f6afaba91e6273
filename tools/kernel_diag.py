"""One kernel launch per invocation, for debugging on the GPU under a time limit, compute-sanitizer
or cuda-gdb (a hang or a fault then costs one small process, not a test file).

    python tools/kernel_diag.py CASE [SPLIT]

CASE: k2_nolora (K2 alone, x_q given, no adapter, n_quant 0), shrink (the shrink+quant kernel
alone), decode (shrink then the self-quantizing K2 with PDL, 3 tokens), decode_xgate (the x-gated
pair chained through the op, bit for bit the unchained calls), decode_xq (shrink+quant
then the x_q K2), decode_split2 (decode with the shrink split as K2), decode_tt (the pair at 40
tokens: K2's token tiles), decode_wide (decode with the wide self-quantizing K2, K = 2176),
expand (expand_add), expand_hb / expand_ct (its bf16-h and column-sweeping builds against the
default, bit for bit), k1 (K1 quant+shrink), k1_hb / k1_wg (its
bf16-h build; its WGMMA build against the selection), prefill_pers (K1 then the persistent prefill K2; SPLIT = its CTA count).
Prints "CASE ok" with the maximum error against the reference, after a device synchronize.
The K2 builds follow EPILORA_K2_PUSH (k2_gemm.push_variant: `maxima`, `partials`, both by default, `none`) like
the ops do; the K2 build launched is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epilora_cute.reference import quantize_fp8_per_token  # noqa: E402


def k2_nolora(split: int, M: int = 8, N: int = 256, K: int = 1024) -> float:
    from kernels_dsl import k2_gemm
    from tests.test_k2_gpu import DecodePath, _kernel, _launch, _x

    dp = DecodePath((N,), K, 16, 2, M, seed=3)
    x = _x(M, K, 3)
    xq, sx = quantize_fp8_per_token(x)
    dp.x_q.copy_(xq)
    dp.x_scale.copy_(sx.reshape(-1))
    _, cfg = k2_gemm.select((N,), M)
    print("k2 build", cfg.name(), flush=True)
    spec = k2_gemm.launch(cfg, w_q=dp.w_codes, w_scale=dp.w_scale, x_q=dp.x_q, x_scale=dp.x_scale, y=dp.y,
                          sync=dp.sync, n_quant=0, split=split)
    dp.y.fill_(float("nan"))
    print("launch", {k: v for k, v in spec.items() if k != "args"}, flush=True)
    _launch(_kernel(k2_gemm, cfg), spec, pdl=False)
    torch.cuda.synchronize()
    ref = (xq.float() * sx) @ (dp.w_codes.float() * dp.w_scale).t()
    err = (dp.y.float() - ref).abs()
    bad = (err > 0.02 + 0.02 * ref.abs()).nonzero()
    print(f"bad elements {bad.shape[0]} of {err.numel()}; first (token, column): {bad[:8].tolist()}")
    if bad.shape[0]:
        print("bad tokens", sorted(set(bad[:, 0].tolist())), "bad column blocks of 64",
              sorted(set((bad[:, 1] // 64).tolist()))[:20])
    return err.max().item()


def _decode_path(M=3, self_quant=True, K=1024, wide=None):
    from tests.test_k2_gpu import DecodePath, _tokens, _x

    widths = (128, 128, 128)
    dp = DecodePath(widths, K, 64, 4, M, seed=1, self_quant=self_quant, wide=wide)
    return dp, _x(M, K, 1), _tokens(M, 3, 1)


def shrink(split: int) -> float:
    from epilora_cute.metadata import build_meta
    from kernels_dsl import lora_shrink as shrink_mod
    from tests.test_k2_gpu import _kernel, _launch

    dp, x, tok = _decode_path()
    meta = build_meta(tok.cuda(), dp.L)
    cfg = shrink_mod.select(3, dp.M, dp.rank)
    spec = shrink_mod.launch(cfg, x=x, lora_a=dp.lora_a, h=dp.h, x_q=dp.x_q, x_scale=dp.x_scale, sync=dp.sync,
                             token_lora=meta.token_lora_mapping[:dp.M], active_lora_ids=meta.active_lora_ids,
                             num_active=meta.num_active, slot_ranks=dp.slot_ranks, split=split)
    print("launch", {k: v for k, v in spec.items() if k != "args"}, flush=True)
    _launch(_kernel(shrink_mod, cfg), spec)
    torch.cuda.synchronize()
    xq, sx = quantize_fp8_per_token(x)
    assert torch.equal(dp.x_q.view(torch.uint8), xq.view(torch.uint8)), "x_q differs"
    return (dp.x_scale - sx.reshape(-1)).abs().max().item()


def decode(split: int, self_quant: bool = True, split_shrink: int = 1, M: int = 3) -> float:
    dp, x, tok = _decode_path(M=M, self_quant=self_quant)
    y = dp.run(x, tok, split_k2=split, split_shrink=split_shrink)
    print("k2 build", dp.k_cfg.name(), flush=True)
    torch.cuda.synchronize()
    dp.check(x, tok, y)
    return 0.0


def decode_xgate(split: int, M: int = 3, K: int = 1024) -> float:
    """The x-gated decode_sq pair (v1.03, EPILORA_K2_XGATE=1) through the op: one K x K projection
    chained onto itself four times (the gate buffer's halves in turn), each call's x the previous
    call's y, bit for bit the unchained calls (SPLIT unused: the op's own splits)."""
    import os

    from epilora_cute import ops, reference
    from epilora_cute.metadata import build_meta

    os.environ["EPILORA_K2_XGATE"] = "1"
    g = torch.Generator(device="cuda").manual_seed(5)
    x0 = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    wq, ws = reference.quantize_fp8_per_tensor(torch.randn(K, K, device="cuda", generator=g) * 0.02)
    a = [(torch.randn(4, 1, 64, K, device="cuda", generator=g) * 0.02).bfloat16()]
    b = [(torch.randn(4, 1, K, 64, device="cuda", generator=g) * 0.02).bfloat16()]
    mapping = torch.tensor(([0, -1, 2] * M)[:M], dtype=torch.int32, device="cuda")
    meta = build_meta(mapping, 4)

    def seq(chain: bool):
        ys, x = [], x0
        for _ in range(4):
            x = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode_sq", chain_pdl=chain)
            ys.append(x)
        torch.cuda.synchronize()
        return ys

    seq(True)  # the cached tensors and the gate buffer are made
    gated, plain = seq(True), seq(False)
    assert all(torch.equal(p, q) for p, q in zip(gated, plain)), "the x-gated chain differs from the unchained calls"
    assert not ops._xgate_buffer(torch.device("cuda")).any(), "the gate buffer is not re-armed"
    return 0.0


def decode_xq(split: int, M: int = 3) -> float:
    """decode with the quantization in the shrink (x_q given to K2); M tokens (one token tile: <= 32)."""
    return decode(split, self_quant=False, M=M)


def decode_split2(split: int) -> float:
    """decode with the shrink split too (its cluster reduction, the h hand-off, under racecheck)."""
    return decode(split, split_shrink=split)


def decode_tt(split: int, M: int = 40) -> float:
    """The decode pair at 40 tokens: the shrink's 64-token tile, then K2's token-tile build (two
    tiles per weight block; the second one's x_q rows 32..39 and TMA zero fill past them, its
    offset s_x / y / h / adapter table), the shrink split as K2."""
    return decode(split, self_quant=False, split_shrink=split, M=M)


def decode_wide(split: int) -> float:
    """decode with the wide self-quantizing K2 (Config.sq_xblocks) on K = 2176: 17 k-blocks, more
    than a default build's CTA holds, so split 1 runs only this build (K = 2560 did not finish
    under racecheck in 45 s)."""
    dp, x, tok = _decode_path(K=2176, wide="always")
    y = dp.run(x, tok, split_k2=split, split_shrink=1)
    print("k2 build", dp.k_cfg.name(), flush=True)
    torch.cuda.synchronize()
    dp.check(x, tok, y)
    return 0.0


def expand(_split: int) -> float:
    from tests import test_expand_add as T

    T.test_gpu_matches_reference(33, 1)
    return 0.0


def k1(_split: int) -> float:
    from tests import test_k1_shrink as T

    T.test_gpu_matches_reference(33, 1)
    return 0.0


def expand_hb(_split: int) -> float:
    """The expand-add reading a bf16 h (v0.71) against its fp32-h y, bit for bit."""
    from tests import test_expand_add as T

    T.test_gpu_bf16_h_is_bitwise_fp32_h(33, 8, 64, (4096, 1024, 1024))
    return 0.0


def expand_ct(_split: int) -> float:
    """The expand-add sweeping four column tiles per CTA (v0.72) against its one-tile build, bit
    for bit: the B ring across tiles and the epilogue tile beside it (racecheck's case)."""
    from tests import test_expand_add as T

    T.test_gpu_sweep_and_ring_builds_are_bitwise_one_tile(*T.CT_GPU_CASES[3])
    return 0.0


def k1_hb(_split: int) -> float:
    """K1 storing h as bf16 (v0.71) against its fp32 h, bit for bit."""
    from tests import test_k1_shrink as T

    T.test_gpu_h_bf16_is_the_rounded_fp32_h(33, 1, 64, 4096, 3)
    return 0.0


def k1_wg(_split: int) -> float:
    """K1 with its shrink on WGMMA (v0.74): several adapter groups per tile, the cp.async ring read
    by WGMMA after the proxy fence, each group's columns stored after it (racecheck's case)."""
    from tests import test_k1_shrink as T

    case = next(c for c in T.WGMMA_CASES if c[1] > 1)
    print("k1 build", case[-1].name(), flush=True)
    T.test_gpu_wgmma_matches_the_selection(*case)
    return 0.0


def prefill_pers(ctas: int) -> float:
    """K1, then the persistent prefill K2 (adapter build) with `ctas` CTAs walking 20 tiles of 64
    tokens x 128 features, up to 8 adapter groups per tile: the stage and B rings wrap across
    tiles, the per-tile smem (token indices, scales, output tile) is reused (racecheck's case)."""
    from kernels_dsl import k2_prefill as P
    from tests.test_k2_prefill import PrefillPath, _tokens, _x

    widths, K, M = (256, 128, 128), 512, 300
    pp = PrefillPath(widths, K, 64, 8, M, seed=2)
    x, tok = _x(M, K, 2), _tokens(M, 8, 2)
    y = pp.run(x, tok, build=P.PERSISTENT_BUILD, ctas=ctas)
    torch.cuda.synchronize()
    pp.check(x, tok, y)
    return 0.0


def stream(_split: int) -> float:
    """The streamed shrink (v0.88) on 130 tokens of 8 adapters with mixed ranks and no-adapter rows:
    64- and 128-row tiles, one split and a cluster of 8 (the ring drained for the fp32 partials, the
    DSMEM sum in split order; racecheck's case), each against the reference."""
    from tests import test_shrink_stream as T

    T.test_gpu_matches_reference(130, 8)
    return 0.0


CASES = {f.__name__: f for f in (k2_nolora, shrink, decode, decode_xgate, decode_xq, decode_split2, decode_tt, decode_wide, expand,
                                 k1, expand_hb, expand_ct, k1_hb, k1_wg, prefill_pers, stream)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python tools/kernel_diag.py CASE [SPLIT]; CASE one of {', '.join(CASES)}")
    case = sys.argv[1]
    split = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    extra = [int(a) for a in sys.argv[3:]]  # k2_nolora: M N K; decode_xq / decode_tt: M
    err = CASES[case](split, *extra)
    print(f"{case} ok (split {split}) max error {err:.3g}", flush=True)
