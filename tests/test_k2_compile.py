"""The decode-path kernels (K2 and shrink+quant) compile for sm_90a here, with both DSL versions.

Checks per configuration: the PTX holds what it must (FP8 WGMMA, the PDL wait after the main
loop only in the adapter variant, setmaxnreg, TMA, the x_q flag protocol, cluster reduction,
the bit-exact quantization instructions, the PDL order that lets the shrink be chained behind
the previous projection and K2's trigger for it), the .entry parameters match the declared parameter
list (size and alignment), and the declared dynamic smem equals the DSL's own struct size.
The DSL's host code is also run with stub CUDA functions (kernels_dsl.host_capture) to check the
declared TMA specs and parameter packing against the bytes the DSL itself would launch with.

Run as a script (`python tests/test_k2_compile.py fast|all`) it prints one JSON line of
results: that is how the 4.6.0 venv checks the same configurations in a subprocess.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from kernels_dsl import k2_gemm, lora_shrink  # noqa: E402
from epilora_cute.cubin_info import register_pool_problem, stack_frame_bytes  # noqa: E402
from kernels_dsl._abi import ptx_entry_params  # noqa: E402
from tests.dsl46 import SHARDS, run_dsl46  # noqa: E402


FAST_K2 = [
    k2_gemm.Config(bn=8, lora=False),
    k2_gemm.Config(bn=16, lora=True, num_slices=3, rank=64),
    k2_gemm.Config(bn=32, lora=True, num_slices=2, rank=256),
    k2_gemm.Config(bm=64, bn=8, lora=True, num_slices=2, rank=8),
    k2_gemm.Config(bn=8, lora=True, num_slices=3, rank=64, ctas=2),
    k2_gemm.Config(bn=32, lora=True, num_slices=3, rank=64, stages=8),
    # The self-quantizing builds (1..8 tokens): no adapter, and an adapter build of each B ring.
    k2_gemm.default_config(8, 128, lora=False, self_quant=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True),
    k2_gemm.default_config(8, 64, lora=True, num_slices=2, rank=16, self_quant=True),
    # K2 computing h too (decode_fh): rank 8 (a partial rank chunk of rows) and 256 (several).
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, fused_h=True),
    k2_gemm.default_config(8, 64, lora=True, num_slices=1, rank=8, self_quant=True, fused_h=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=2, rank=256, self_quant=True, fused_h=True),
    # The push variants (EPILORA_K2_PUSH): partials at every token tile, maxima on the
    # self-quantizing builds, both together; bm 64 (the 72B gate_up).
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, push_partials=True),
    k2_gemm.default_config(32, 128, lora=True, num_slices=1, rank=64, push_partials=True),
    k2_gemm.default_config(16, 64, lora=False, push_partials=True),
    k2_gemm.default_config(8, 128, lora=False, self_quant=True, push_maxima=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, push_maxima=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, push_partials=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, push_maxima=True,
                           push_partials=True),
    k2_gemm.default_config(8, 64, lora=False, self_quant=True, push_maxima=True, push_partials=True),
    # The wide self-quantizing builds (32 resident k-blocks, EPILORA_K2_SQ_WIDE): the shipped
    # pushes on gate_up's (2 slices, 3 stages), none on down's; the no-adapter one.
    k2_gemm.default_config(8, 128, lora=True, num_slices=2, rank=64, self_quant=True, push_maxima=True,
                           push_partials=True, sq_xblocks=32),
    k2_gemm.default_config(8, 128, lora=True, num_slices=1, rank=64, self_quant=True, sq_xblocks=32),
    k2_gemm.default_config(8, 128, lora=False, self_quant=True, push_partials=True, sq_xblocks=32),
    # The x-gated pair's K2 (EPILORA_K2_XGATE): one B buffer (qkv), two (bm 64, wide), the shipped
    # pushes.
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, xgate=True),
    k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, push_maxima=True,
                           push_partials=True, xgate=True),
    k2_gemm.default_config(8, 64, lora=True, num_slices=2, rank=64, self_quant=True, sq_xblocks=32, xgate=True),
]
FAST_SHRINK = [
    lora_shrink.select(3, 16, 64),  # the decode path's build (8 stages)
    lora_shrink.Config(bn=16, rank=64, num_slices=3),
    lora_shrink.Config(bn=8, rank=8, num_slices=1),
    lora_shrink.Config(bn=32, rank=256, num_slices=2),
    lora_shrink.select(2, 4, 128, quant=False),  # beside the self-quantizing K2
    lora_shrink.Config(bn=8, rank=64, num_slices=3, quant=False, stages=8, xgate=True),  # beside the x-gated K2
]


def _lines_index(ptx: str, pat: str) -> list[int]:
    return [i for i, ln in enumerate(ptx.splitlines()) if re.search(pat, ln)]


def _entry_points(ptx: str, idxs: list[int]) -> list[int]:
    """Where control reaches each line, in code order: the line itself, or, for a block that
    the compiler placed out of line (the line before its label is an unconditional branch or a
    return: no fall through), the first branch to that label. Sorted."""
    lines = ptx.splitlines()
    out = []
    for i in idxs:
        at = i
        lab = next((j for j in range(i, -1, -1) if re.match(r"^\$L\w+:", lines[j])), None)
        if lab is not None and lab > 0 and re.match(r"^\s*(bra(\.uni)?\s|ret;|exit;)", lines[lab - 1]):
            name = lines[lab].strip()[:-1]
            srcs = [j for j, ln in enumerate(lines) if re.search(rf"\bbra(\.uni)?\s+{re.escape(name)};", ln)]
            if srcs:
                at = min(srcs)
        out.append(at)
    return sorted(out)


def k2_ptx_problems(cfg: k2_gemm.Config, ptx: str) -> list[str]:
    bad = []
    fp8 = _lines_index(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.bn}k32\.f32\.e4m3\.e4m3")
    bf = _lines_index(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.bn}k16\.f32\.bf16\.bf16")
    # The producer's wait sits in a branch taken only for n_quant = 0, which ptxas may place at
    # the end of the code: each wait is located where control enters its block.
    wait = _entry_points(ptx, _lines_index(ptx, r"griddepcontrol\.wait"))
    if not fp8:
        bad.append("no e4m3 x e4m3 WGMMA with the token tile as N")
    if not re.search(rf"setmaxnreg.dec.sync.aligned.u32\s+{k2_gemm.PRODUCER_REGS};", ptx):
        bad.append("missing setmaxnreg.dec (producer)")
    if not re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{cfg.consumer_regs};", ptx):
        bad.append("missing setmaxnreg.inc (consumer)")
    # The x_q protocol (spin on the quantization CTAs' counter), or for self_quant builds the
    # quantization itself: 16-byte code stores into smem, made visible to the WGMMA's async proxy.
    protocol = (("st.shared.v4.b32", "cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "fence.proxy.async.shared::cta")
                if cfg.self_quant else
                ("ld.acquire.gpu.global.s32", "fence.proxy.async.global", "atom.acq_rel.gpu.global.add.s32"))
    # The push variants: no DSMEM loads where both exchanges push (the self-quantizing builds
    # without push_maxima still load the peers' maxima).
    dsmem_loads = not (cfg.push_partials and (cfg.push_maxima or not cfg.self_quant))
    for ins in ("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes",
                "barrier.cluster.arrive", "barrier.cluster.wait", "mapa.shared::cluster.u32"
                ) + (("ld.shared::cluster.f32",) if dsmem_loads else ()) + protocol:
        if ins not in ptx:
            bad.append(f"missing {ins}")
    bad += push_ptx_problems(cfg, ptx, dsmem_loads)
    if cfg.fused_h:
        # h inside K2: the partials are published (red.release) before the main loop, acquired
        # after it and before the epilogue's WGMMA, read with ld.relaxed.gpu; the only
        # griddepcontrol.wait is the one before x is loaded (chained behind the previous kernel).
        rel = _lines_index(ptx, r"red\.release\.gpu\.global\.add\.s32")
        acq = _entry_points(ptx, _lines_index(ptx, r"ld\.acquire\.gpu\.global\.s32"))
        if not rel or (fp8 and not max(rel) < min(fp8)):
            bad.append("h's partials are not published before the main loop")
        if not acq or (fp8 and not min(acq) > max(fp8)) or (bf and not max(acq) < min(bf)):
            bad.append("h's partials are not acquired between the main loop and the epilogue WGMMA")
        for ins in ("ld.relaxed.gpu.global.f32", "atom.relaxed.gpu.global.add.s32", "st.relaxed.gpu.global.s32"):
            if ins not in ptx:
                bad.append(f"missing {ins}")
        ldx = _lines_index(ptx, r"ld\.global\.(nc\.)?v4")
        if len(wait) != 1 or (ldx and not wait[0] < min(ldx)):
            bad.append("expected one griddepcontrol.wait, before the loads of x")
        if not bf:
            bad.append("no bf16 epilogue WGMMA")
        return bad + _trigger_problems(ptx, fp8)
    if cfg.xgate:
        bad += xgate_problems(ptx, fp8)
    elif cfg.self_quant:
        for ins in ("ld.acquire.gpu", "atom.acq_rel.gpu", "red.release.gpu"):
            if ins in ptx:
                bad.append(f"{ins} in a self_quant build (it depends on no counter)")
        # The quantization's loads of x come before the first WGMMA; an adapter build has only the
        # epilogue's griddepcontrol.wait (checked below), a no-adapter one waits before loading x.
        ldx = _lines_index(ptx, r"ld\.global\.(nc\.)?v4")
        if not ldx or (fp8 and not max(ldx[:1]) < min(fp8)):
            bad.append("no 16-byte loads of x before the main loop")
    # The producer's griddepcontrol.wait (taken only when n_quant = 0: x_q from the standalone
    # quantization kernel, whose PDL dependent this K2 then is) precedes the main loop's WGMMAs in
    # the code; an adapter build's consumer waits once more, after the main loop, before the
    # epilogue's WGMMA (h comes from the shrink kernel).
    if cfg.self_quant and cfg.lora:
        if len(wait) != 1:
            bad.append(f"{len(wait)} griddepcontrol.wait (expected the epilogue's only)")
        elif fp8 and not (wait[0] > max(fp8)):
            bad.append("the epilogue's griddepcontrol.wait is not after the main loop")
        if not bf:
            bad.append("no bf16 epilogue WGMMA")
        elif wait and not (wait[0] < min(bf)):
            bad.append("griddepcontrol.wait is not before the epilogue WGMMA")
        return bad + (_gated_trigger_problems(ptx, fp8) if cfg.xgate else _trigger_problems(ptx, fp8))
    if not wait or (fp8 and not wait[0] < min(fp8)):
        bad.append("no griddepcontrol.wait before the main loop (the producer's, for n_quant = 0)")
    if cfg.lora:
        if len(wait) != 2:
            bad.append(f"{len(wait)} griddepcontrol.wait (expected the producer's and the epilogue's)")
        elif fp8 and not (wait[1] > max(fp8)):
            bad.append("the epilogue's griddepcontrol.wait is not after the main loop")
        if not bf:
            bad.append("no bf16 epilogue WGMMA")
        elif len(wait) == 2 and not (wait[1] < min(bf)):
            bad.append("griddepcontrol.wait is not before the epilogue WGMMA")
        # The B chunks are requested by producer warp 1, which never executes griddepcontrol.wait.
    else:
        if len(wait) != 1:
            bad.append(f"{len(wait)} griddepcontrol.wait in the no-adapter variant (expected the producer's)")
        if bf:
            bad.append("epilogue WGMMA in the no-adapter variant")
    return bad + _trigger_problems(ptx, fp8)


def push_ptx_problems(cfg, ptx: str, dsmem_loads: bool) -> list[str]:
    """The push variants (Config.push_maxima / push_partials): st.async with complete_tx into the
    peers, waited for with an acquire.cluster mbarrier wait; the release cluster arrives left are
    the maxima's phase (self_quant without push_maxima: producer + consumer) and the partials'
    phase (without push_partials: the consumer's; the producer's too without either flag)."""
    if not (cfg.push_maxima or cfg.push_partials):
        return []
    bad = []
    for ins in ("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32",
                "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64", "mbarrier.arrive.expect_tx",
                "barrier.cluster.arrive.relaxed"):
        if ins not in ptx:
            bad.append(f"missing {ins}")
    if cfg.push_partials:
        for ins in ("mul.hi.u32", "div.u32"):
            if ins not in ptx:
                bad.append(f"missing {ins} (the owner's magic-number division)")
    if not dsmem_loads and "ld.shared::cluster" in ptx:
        bad.append("DSMEM loads left in a build whose exchanges all push")
    release = len(re.findall(r"barrier\.cluster\.arrive(?:\.aligned)?;", ptx))
    want = (2 if cfg.self_quant and not cfg.push_maxima else 0) + (0 if cfg.push_partials else 1)
    if release != want:
        bad.append(f"{release} release cluster arrives (expected {want})")
    return bad


def _trigger_problems(ptx: str, fp8: list[int]) -> list[str]:
    # One trigger, right after the prologue (barrier init), before any TMA or WGMMA: the next
    # projection's first kernel (chained) is scheduled under this K2 and waits for it.
    bad = []
    trig = _lines_index(ptx, r"griddepcontrol\.launch_dependents")
    init = _lines_index(ptx, r"mbarrier\.init")
    tma = _lines_index(ptx, r"cp\.async\.bulk\.tensor")
    if len(trig) != 1:
        bad.append(f"{len(trig)} griddepcontrol.launch_dependents (expected one, after the prologue)")
    elif not (init and trig[0] > max(init)) or (tma and trig[0] > min(tma)) or (fp8 and trig[0] > min(fp8)):
        bad.append("launch_dependents is not between the prologue's barrier init and the first TMA / WGMMA")
    return bad


def xgate_problems(ptx: str, fp8: list[int]) -> list[str]:
    """The x gate (k2_gemm.Config.xgate): sync[0] acquired before x is loaded and before the main
    loop, the CTAs past the gate counted (acq_rel) and the counters re-armed (relaxed stores); the
    K2 itself publishes nothing with a release."""
    bad = []
    for ins in ("ld.acquire.gpu.global.s32", "atom.acq_rel.gpu.global.add.s32", "st.relaxed.gpu.global.s32"):
        if ins not in ptx:
            bad.append(f"missing {ins} (the x gate)")
    if "red.release.gpu" in ptx:
        bad.append("red.release.gpu in an xgate K2 (only the shrink publishes)")
    acq = _lines_index(ptx, r"ld\.acquire\.gpu\.global\.s32")
    ldx = _lines_index(ptx, r"ld\.global\.(nc\.)?v4")
    if acq and ldx and not min(acq) < min(ldx):
        bad.append("x is loaded before the gate's acquire")
    if acq and fp8 and not max(acq) < min(fp8):
        bad.append("the gate's acquire is not before the main loop")
    return bad


def _gated_trigger_problems(ptx: str, fp8: list[int]) -> list[str]:
    # xgate builds: each trigger right after a wait on sx_ready (the producer warps: an mbarrier
    # try_wait loop) or the consumer's arrival on it (past the gate), none in the prologue, so that
    # no thread of the CTA triggers before the gate.
    bad = []
    lines = ptx.splitlines()
    trig = _lines_index(ptx, r"griddepcontrol\.launch_dependents")
    if len(trig) < 3:
        bad.append(f"{len(trig)} griddepcontrol.launch_dependents (expected one per warp role, past the gate)")
    for t in trig:
        near = [ln for ln in lines[max(0, t - 8):t] if re.search(r"mbarrier\.(try_wait|arrive)", ln) or "DONE:" in ln]
        if not near:
            bad.append(f"launch_dependents at PTX line {t} does not follow a wait on / arrival at sx_ready")
            break
    return bad


def tma_lines_by_param(ptx: str) -> dict[int, list[int]]:
    """Line numbers of the TMA loads, per descriptor: its parameter index in the .entry list
    (followed through `mov.b64 %rd, <entry>_param_N` and `cvta.param.u64 %rd, %rd`)."""
    lines = ptx.splitlines()
    reg_param = {}
    for ln in lines:
        m = re.search(r"mov\.[bu]64\s+(%rd\d+),\s+\S+_param_(\d+);", ln)
        if m:
            reg_param[m.group(1)] = int(m.group(2))
    for ln in lines:
        m = re.search(r"cvta\.param\.u64\s+(%rd\d+),\s+(%rd\d+);", ln)
        if m and m.group(2) in reg_param:
            reg_param[m.group(1)] = reg_param[m.group(2)]
    out: dict[int, list[int]] = {}
    for i, ln in enumerate(lines):
        m = re.search(r"cp\.async\.bulk\.tensor\.\S+\s+\[[^\]]*\],\s+\[(%rd\d+),", ln)
        if m and m.group(1) in reg_param:
            out.setdefault(reg_param[m.group(1)], []).append(i)
    return out


def shrink_ptx_problems(cfg: lora_shrink.Config, ptx: str) -> list[str]:
    bad = []
    if not _lines_index(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.bn}k16\.f32\.bf16\.bf16"):
        bad.append("no bf16 WGMMA with the token tile as N")
    if not _lines_index(ptx, r"wgmma\.wait_group\.sync\.aligned\s+1\b"):
        bad.append("no WGMMA group kept in flight across k-blocks (wait_group 1)")
    need = ["griddepcontrol.launch_dependents", "cp.async.bulk.tensor.2d", "barrier.cluster.arrive",
            "ld.shared::cluster.f32"]
    quant = ["div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "red.release.gpu.global.add.s32", "fence.acq_rel.gpu",
             "max.f32", "min.f32", "abs.f32"]
    for ins in need + (quant if cfg.quant else []):
        if ins not in ptx:
            bad.append(f"missing {ins}")
    if not cfg.quant:  # the down-projection alone never touches the x_q flag (xgate: its gate)
        for ins in ("cvt.rn.satfinite.e4m3x2.f32",) + (() if cfg.xgate else ("red.release.gpu.global.add.s32",)):
            if ins in ptx:
                bad.append(f"unexpected {ins} without quantization")
        if cfg.xgate:
            for ins in ("red.release.gpu.global.add.s32", "fence.acq_rel.gpu"):
                if ins not in ptx:
                    bad.append(f"missing {ins} (the x gate's publication)")
    for ins in ("div.approx", "div.full", ".ftz", "max.NaN", "min.NaN"):
        if ins in ptx:
            bad.append(f"unexpected {ins}")
    return bad + shrink_pdl_problems(cfg, ptx)


def shrink_pdl_problems(cfg: lora_shrink.Config, ptx: str) -> list[str]:
    """The PDL order that makes chaining the shrink safe (kernels_dsl/lora_shrink.py): each part
    (the quantization CTAs, then the down-projection CTAs, in the PTX's order) executes
    griddepcontrol.wait, then launch_dependents, before its global stores and before it reads x;
    the down-projection requests its first A stages (and prefetches x's descriptor) between its
    barrier init and the wait, and x's stages after it."""
    bad = []
    wait = _lines_index(ptx, r"griddepcontrol\.wait")
    trig = _lines_index(ptx, r"griddepcontrol\.launch_dependents")
    if cfg.quant:
        if len(wait) != 2 or len(trig) != 2:
            return [f"{len(wait)} griddepcontrol.wait / {len(trig)} launch_dependents (expected 2 each)"]
        seq = sorted([(i, "w") for i in wait] + [(i, "t") for i in trig])
        if [k for _, k in seq] != ["w", "t"] * 2:
            bad.append("griddepcontrol.launch_dependents does not follow each griddepcontrol.wait")
    elif cfg.xgate:
        # The x gate: every CTA triggers, then waits, first thing; the only global write before
        # the down-projection's h is the gate's publication, after the wait.
        if len(wait) != 1 or len(trig) != 1:
            return [f"{len(wait)} griddepcontrol.wait / {len(trig)} launch_dependents (expected 1 each)"]
        init = _lines_index(ptx, r"mbarrier\.init")
        tma = _lines_index(ptx, r"cp\.async\.bulk\.tensor")
        stores = _lines_index(ptx, r"^\s*(?:@!?%p\d+\s+)?(?:st\.global|red\.|atom\.)")
        rel = _lines_index(ptx, r"red\.release\.gpu\.global\.add\.s32")
        if not (trig[0] < wait[0] < min(init + tma + [10**9])):
            bad.append("the trigger and then the wait are not first (before the barrier init and the TMA loads)")
        if any(i < wait[0] for i in stores):
            bad.append("a global store before griddepcontrol.wait")
        if len(rel) != 1 or not wait[0] < rel[0] < min(init + tma + [10**9]):
            bad.append("the gate is not published once, right after griddepcontrol.wait")
        return bad
    else:
        # No quantization planes: every CTA waits and triggers first thing (before its barrier
        # init, A loads and any store): the self-quantizing K2 reads x when it starts.
        if len(wait) != 1 or len(trig) != 1:
            return [f"{len(wait)} griddepcontrol.wait / {len(trig)} launch_dependents (expected 1 each)"]
        init = _lines_index(ptx, r"mbarrier\.init")
        tma = _lines_index(ptx, r"cp\.async\.bulk\.tensor")
        stores = _lines_index(ptx, r"^\s*(?:@!?%p\d+\s+)?(?:st\.global|red\.|atom\.)")
        if not (wait[0] < trig[0] < min(init + tma + [10**9])):
            bad.append("the wait and the trigger are not first (before the barrier init and the TMA loads)")
        if any(i < wait[0] for i in stores if not (cfg.trace and "%globaltimer" in ptx.splitlines()[i - 1])):
            bad.append("a global store before griddepcontrol.wait")
        return bad
    init = _lines_index(ptx, r"mbarrier\.init")
    if not init:
        return bad + ["no mbarrier.init (down-projection)"]
    down_wait = max(w for w in wait if w < trig[-1])  # the one the down-projection's trigger follows
    if down_wait < min(init):
        bad.append("the down-projection's griddepcontrol.wait is before its barrier init")
    lines = ptx.splitlines()
    for i in _lines_index(ptx, r"^\s*(?:@!?%p\d+\s+)?(?:st\.global|red\.|atom\.)"):
        if cfg.trace and "st.global.u64" in lines[i] and "mov.u64" in lines[i - 1] and "%globaltimer" in lines[i - 1]:
            continue  # a trace build's timeline stamp: its own buffer, which no other kernel reads
        if i < wait[0] or min(init) < i < down_wait:
            bad.append(f"global store/reduction at PTX line {i} before its part's griddepcontrol.wait")
            break
    if cfg.quant:
        x_ld = _lines_index(ptx, r"ld\.global\.v4")
        if not x_ld or min(x_ld) < wait[0]:
            bad.append("the quantization's x loads are not after its griddepcontrol.wait")
    names = [p.name for p in lora_shrink.params(cfg)]
    by_param = tma_lines_by_param(ptx)
    x_tma = by_param.get(names.index("tma_x"), [])
    a_tma = [i for s in range(cfg.num_slices) for i in by_param.get(names.index(f"tma_a{s}"), [])]
    if not x_tma or not a_tma:
        return bad + ["could not find the x / A TMA loads by their descriptors"]
    if min(x_tma) < down_wait:
        bad.append("an x TMA load is before the down-projection's griddepcontrol.wait")
    if not any(min(init) < i < down_wait for i in a_tma):
        bad.append("no A TMA load between the barrier init and griddepcontrol.wait (the first stages)")
    if not any(min(init) < i < down_wait for i in _lines_index(ptx, r"prefetch\.tensormap")):
        bad.append("x's descriptor is not prefetched before griddepcontrol.wait")
    return bad


def param_problems(mod, cfg, ptx: str) -> list[str]:
    entries = ptx_entry_params(ptx)
    if len(entries) != 1:
        return [f"{len(entries)} kernels in the module"]
    (name, got), = entries.items()
    declared = mod.params(cfg)
    want = [(64 if p.size == 128 and type(p).__name__ == "TmaParam" else
             8 if type(p).__name__ == "TensorParam" else 4, p.size) for p in declared]
    if [s for _, s in got] != [s for _, s in want]:
        return [f"param sizes {[s for _, s in got]} != declared {[s for _, s in want]}"]
    if [a for a, _ in got] != [a for a, _ in want]:
        return [f"param alignments {[a for a, _ in got]} != declared {[a for a, _ in want]}"]
    return []


def check_config(mod, cfg) -> dict:
    with tempfile.TemporaryDirectory() as d:
        f = mod.compile(cfg, f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {d}")
        ptxs = sorted(Path(d).glob("*.ptx"))
        cubins = sorted(Path(d).glob("*.cubin"))
        ptx = ptxs[0].read_text() if ptxs else ""
        cubin = cubins[0].read_bytes() if cubins else b""
        cubin_ok = cubin[:4] == b"\x7fELF"
    bad = (k2_ptx_problems(cfg, ptx) if mod is k2_gemm else shrink_ptx_problems(cfg, ptx))
    bad += param_problems(mod, cfg, ptx)
    if ".target sm_90a" not in ptx:
        bad.append("not sm_90a")
    if not cubin_ok:
        bad.append("no cubin")
    else:
        pool = register_pool_problem(ptx, cubin)
        if pool:
            bad.append(pool)
        # A stack frame here means spilled registers: local-memory traffic in the main loop or
        # the reduction of a kernel whose whole point is a short fixed cost (K2's reduction
        # spilled up to 940 B until it moved inside the consumer branch).
        frame = stack_frame_bytes(cubin)
        if frame:
            bad.append(f"{frame} B stack frame (register spills)")
    smem = getattr(f, "epilora_smem_bytes", None)
    if smem is not None and smem != cfg.smem_bytes():
        bad.append(f"smem_bytes() {cfg.smem_bytes()} != DSL struct {smem}")
    if cfg.smem_bytes() > 227 * 1024:
        bad.append(f"smem {cfg.smem_bytes()} exceeds 227 KiB")
    if mod is k2_gemm:
        if not re.search(rf"\.minnctapersm\s+{cfg.ctas}\b", ptx):
            bad.append(f"no .minnctapersm {cfg.ctas}")
        if not cfg.fits_ctas():
            bad.append(f"{cfg.ctas} CTAs of {cfg.smem_bytes()} B do not fit one SM's shared memory")
    ver = re.search(r"\.version (\S+)", ptx)
    return {"family": mod.FAMILY, "config": cfg.name(), "problems": bad, "ptx_version": ver.group(1) if ver else None}


def _configs(which: str):
    if which == "fast":
        return [(k2_gemm, c) for c in FAST_K2] + [(lora_shrink, c) for c in FAST_SHRINK]
    return [(k2_gemm, c) for c in k2_gemm.prebuild_configs()] + [(lora_shrink, c) for c in lora_shrink.prebuild_configs()]


# ---------------------------------------------------------------------------------------------
# DSL installed in this interpreter (4.8.x in the project venv)
# ---------------------------------------------------------------------------------------------

dsl = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("cfg", FAST_K2, ids=lambda c: c.name())
def test_k2_compiles(cfg):
    r = check_config(k2_gemm, cfg)
    assert not r["problems"], r


@pytest.mark.parametrize("cfg", FAST_SHRINK, ids=lambda c: c.name())
def test_shrink_compiles(cfg):
    r = check_config(lora_shrink, cfg)
    assert not r["problems"], r


@pytest.mark.slow
@pytest.mark.parametrize("cfg", k2_gemm.prebuild_configs(), ids=lambda c: c.name())
def test_k2_prebuild_set_compiles(cfg):
    r = check_config(k2_gemm, cfg)
    assert not r["problems"], r


@pytest.mark.slow
@pytest.mark.parametrize("cfg", lora_shrink.prebuild_configs(), ids=lambda c: c.name())
def test_shrink_prebuild_set_compiles(cfg):
    r = check_config(lora_shrink, cfg)
    assert not r["problems"], r


def test_prebuild_set_covers_decode_shapes():
    """Every projection of the supported models, token tile and rank has its configurations."""
    k2s, shs = set(k2_gemm.prebuild_configs()), set(lora_shrink.prebuild_configs())
    for model, tp, proj, widths, k in k2_gemm.projection_shapes():
        cfgs = k2_gemm.configs_for(widths)
        for m in (1, 7, 8, 9, 16, 17, 31, 32, 33, 48, 64):
            for r in k2_gemm.RANKS:
                c_l, c_n = k2_gemm.select(widths, m, r)
                assert c_l in k2s and c_n in k2s, (model, tp, proj, m, r)
                assert lora_shrink.select(len(widths), m, r) in shs
        assert all(w % cfgs[0].bm == 0 for w in widths)
        s = k2_gemm.choose_split(sum(widths), k, cfgs[0].bm)
        assert 1 <= s <= 8


# ---------------------------------------------------------------------------------------------
# The DSL's own host code, run with stub CUDA functions
# ---------------------------------------------------------------------------------------------

BASE = 0x7F0000000000


def _k2_values(cfg, N, K, M, L, widths):
    R = cfg.rank
    v = dict(w=dict(data=BASE, shapes=[N, K], strides=[K]),
             xq=dict(data=BASE + 0x1000_0000, shapes=[M, K], strides=[K]),
             sx=dict(data=BASE + 0x2000_0000, shapes=[M]), sw=dict(data=BASE + 0x2000_1000),
             y=dict(data=BASE + 0x3000_0000, shapes=[M, N], strides=[N]),
             sync=dict(data=BASE + 0x4000_0000), n_quant=7)
    if cfg.lora:
        v.update(h=dict(data=BASE + 0x5000_0000, shapes=[M], strides=[M * R]),
                 tok_lora=dict(data=BASE + 0x5100_0000, shapes=[M]),
                 active_ids=dict(data=BASE + 0x5200_0000, shapes=[L + 1]),
                 num_active=dict(data=BASE + 0x5300_0000),
                 slot_ranks=dict(data=BASE + 0x5400_0000, shapes=[L]),
                 slice_start=dict(data=BASE + 0x5500_0000))
        for i, wd in enumerate(widths):
            v[f"b{i}"] = dict(data=BASE + 0x6000_0000 + i * 0x100_0000, shapes=[L * wd], strides=[])
    return v


def _check_tma(hexstr, spec, rows, cols, row_stride_bytes, address):
    from kernels_dsl.host_capture import DSL_DTYPE_CODE, SWIZZLE_CODE, decode_tensormap2d

    d = decode_tensormap2d(hexstr)
    assert d["address"] == address
    assert d["dims"] == (cols, rows), d
    assert d["box"] == tuple(spec.box), d
    assert d["stride1_bytes"] == row_stride_bytes, d
    assert d["swizzle_code"] == SWIZZLE_CODE[spec.swizzle], d
    assert d["dtype_code"] == DSL_DTYPE_CODE[spec.tma_dtype], d


def test_k2_host_capture_matches_declared_abi():
    from kernels_dsl.host_capture import capture_in_subprocess

    N, K, M, L = 6144, 4096, 5, 4
    widths = (4096, 1024, 1024)
    cfg = k2_gemm.Config(bn=16, lora=True, num_slices=3, rank=16)
    out = capture_in_subprocess("kernels_dsl.k2_gemm", cfg, _k2_values(cfg, N, K, M, L, widths))
    ps = k2_gemm.params(cfg)
    raw = dict(zip([p.name for p in ps], out["params"]))
    _check_tma(raw["tma_w"], ps[0].spec, N, K, K, BASE)
    _check_tma(raw["tma_xq"], ps[2].spec, M, K, K, BASE + 0x1000_0000)
    for i, wd in enumerate(widths):
        _check_tma(raw[f"tma_b{i}"], ps[9 + i].spec, L * wd, cfg.rank, 2 * cfg.rank, BASE + 0x6000_0000 + i * 0x100_0000)
    # Non-TMA parameters: the bytes our own packing produces for the same values.
    by_name = {p.name: p for p in ps}
    assert raw["w_dims"][:16] == by_name["w_dims"].pack((N, K)).hex()
    assert raw["xq_dims"][:16] == by_name["xq_dims"].pack((M, K)).hex()
    assert raw["n_quant"][:8] == by_name["n_quant"].pack(7).hex()
    assert raw["b0_dims"][:8] == by_name["b0_dims"].pack((L * widths[0],)).hex()
    assert bytes.fromhex(raw["y"][:48])[:12] == (BASE + 0x3000_0000).to_bytes(8, "little") + M.to_bytes(4, "little")
    assert bytes.fromhex(raw["y"][:48])[12:16] == N.to_bytes(4, "little")
    assert bytes.fromhex(raw["y"][:48])[16:24] == N.to_bytes(8, "little")
    assert bytes.fromhex(raw["h"][:48])[16:24] == (M * cfg.rank).to_bytes(8, "little")
    assert out["smem"] == cfg.smem_bytes()
    assert out["block"] == [256, 1, 1]


def test_shrink_host_capture_matches_declared_abi():
    from kernels_dsl.host_capture import capture_in_subprocess

    M, K, L = 3, 4096, 4
    cfg = lora_shrink.Config(bn=8, rank=16, num_slices=2)
    R = cfg.rank
    v = dict(x=dict(data=BASE, shapes=[M, K], strides=[K]),
             h=dict(data=BASE + 0x5000_0000, shapes=[M], strides=[M * R]),
             xq16=dict(data=BASE + 0x1000_0000, shapes=[M, K // 2], strides=[K // 2]),
             sx=dict(data=BASE + 0x2000_0000, shapes=[M]), sync=dict(data=BASE + 0x4000_0000),
             tok=dict(data=BASE + 0x5100_0000, shapes=[M]), active=dict(data=BASE + 0x5200_0000, shapes=[L + 1]),
             num_active=dict(data=BASE + 0x5300_0000), slot_ranks=dict(data=BASE + 0x5400_0000, shapes=[L]),
             a0=dict(data=BASE + 0x6000_0000, shapes=[L * R, K], strides=[K]),
             a1=dict(data=BASE + 0x6100_0000, shapes=[L * R, K], strides=[K]))
    out = capture_in_subprocess("kernels_dsl.lora_shrink", cfg, v)
    ps = lora_shrink.params(cfg)
    raw = dict(zip([p.name for p in ps], out["params"]))
    _check_tma(raw["tma_x"], ps[2].spec, M, K, 2 * K, BASE)
    _check_tma(raw["tma_a0"], ps[3].spec, L * R, K, 2 * K, BASE + 0x6000_0000)
    _check_tma(raw["tma_a1"], ps[4].spec, L * R, K, 2 * K, BASE + 0x6100_0000)
    assert raw["a1_dims"][:16] == ps[6].pack((L * R, K)).hex()
    assert out["smem"] == cfg.smem_bytes()
    assert out["block"] == [128, 1, 1]


def test_xgate_host_capture_places_the_gate_as_declared():
    """v1.03: the DSL's own host code for the x-gated shrink and K2 passes the gate's pointer where
    params() declares it (after h / after y) and the gate's count as n_quant."""
    from kernels_dsl.host_capture import capture_in_subprocess

    M, K, L = 1, 4096, 4
    s_cfg = lora_shrink.Config(bn=8, rank=64, num_slices=2, quant=False, stages=8, xgate=True)
    R = s_cfg.rank
    gate = BASE + 0x4000_0000
    v = dict(x=dict(data=BASE, shapes=[M, K], strides=[K]),
             h=dict(data=BASE + 0x5000_0000, shapes=[M], strides=[M * R]), sync=dict(data=gate),
             tok=dict(data=BASE + 0x5100_0000, shapes=[M]), active=dict(data=BASE + 0x5200_0000, shapes=[L + 1]),
             num_active=dict(data=BASE + 0x5300_0000), slot_ranks=dict(data=BASE + 0x5400_0000, shapes=[L]),
             a0=dict(data=BASE + 0x6000_0000, shapes=[L * R, K], strides=[K]),
             a1=dict(data=BASE + 0x6100_0000, shapes=[L * R, K], strides=[K]))
    out = capture_in_subprocess("kernels_dsl.lora_shrink", s_cfg, v)
    raw = dict(zip([p.name for p in lora_shrink.params(s_cfg)], out["params"]))
    assert bytes.fromhex(raw["sync"][:16]) == gate.to_bytes(8, "little")
    assert bytes.fromhex(raw["token_lora"][:16]) == (BASE + 0x5100_0000).to_bytes(8, "little")

    widths = (4096, 1024, 1024)
    k_cfg = k2_gemm.default_config(8, 128, lora=True, num_slices=3, rank=64, self_quant=True, xgate=True)
    kv = _k2_values(k_cfg, sum(widths), K, M, L, widths)
    kv["xq"] = dict(data=BASE + 0x1000_0000, shapes=[M, K], strides=[K])  # bf16 x
    kv["sx"] = None
    out = capture_in_subprocess("kernels_dsl.k2_gemm", k_cfg, kv)
    ps = k2_gemm.params(k_cfg)
    raw = dict(zip([p.name for p in ps], out["params"]))
    assert bytes.fromhex(raw["sync"][:16]) == gate.to_bytes(8, "little")
    assert raw["n_quant"][:8] == {p.name: p for p in ps}["n_quant"].pack(7).hex()
    assert out["smem"] == k_cfg.smem_bytes()


# ---------------------------------------------------------------------------------------------
# nvidia-cutlass-dsl 4.6.0 (vLLM 0.26's pin), in its own venv
# ---------------------------------------------------------------------------------------------


def test_dsl46_fast_subset():
    run_dsl46(Path(__file__).resolve(), "fast", 600)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_dsl46_prebuild_set(shard):
    run_dsl46(Path(__file__).resolve(), "all", 3600, shard)


if __name__ == "__main__":
    from tests.dsl46 import script_main

    script_main(_configs("fast"), _configs("all"), lambda it: check_config(*it), lambda it: f"{it[0].FAMILY}/{it[1].name()}")
