"""The public fused op on the GPU, every path it can take, against the reference."""

import pytest
import torch

from epilora_cute import ops, reference
from epilora_cute.metadata import build_meta

pytestmark = pytest.mark.gpu
WIDE = pytest.mark.decode_wide  # the decode pair at 33..64 tokens (K2's token tiles)

QWEN3_8B = {"qkv": ((4096, 1024, 1024), 4096), "o": ((4096,), 4096), "gate_up": ((12288, 12288), 4096),
            "down": ((4096,), 12288)}


def _case(widths, k, m, rank=64, loras=4, adapters=3, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).bfloat16()
    wq, ws = reference.quantize_fp8_per_tensor(torch.randn(sum(widths), k, device="cuda", generator=g) * 0.02)
    a = [(torch.randn(loras, 1, rank, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in widths]
    b = [(torch.randn(loras, 1, n, rank, device="cuda", generator=g) * 0.02).bfloat16() for n in widths]
    mapping = torch.randint(-1, adapters, (m,), device="cuda", generator=g, dtype=torch.int32)
    return x, wq, ws, a, b, mapping


@pytest.fixture
def stream_priority(request):
    """v0.91's setting (the quantization + GEMM of the forked hybrid paths on a high-priority
    stream) for one test, restored after it."""
    before = ops.set_stream_priority(request.param)
    yield request.param
    ops.set_stream_priority(before)


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def _reference(x, wq, ws, a, b, mapping):
    return reference.lora_linear(x, wq, ws, a, b, mapping)


@pytest.mark.parametrize("proj", list(QWEN3_8B))
@pytest.mark.parametrize("m", [1, 3, 8, 16, 31, 32, pytest.param(33, marks=WIDE), pytest.param(48, marks=WIDE),
                               pytest.param(64, marks=WIDE)])
@pytest.mark.parametrize("path,chain", [("decode", False), ("decode", True), ("decode_sq", False), ("decode_sq", True),
                                        ("decode_fh", False), ("decode_fh", True), ("auto", False), ("auto", True)])
def test_decode_path_matches_reference(proj, m, path, chain, monkeypatch):
    monkeypatch.setenv("EPILORA_DECODE_PATH", "1")
    if path in ("decode_sq", "decode_fh") and m > 8:
        pytest.skip(f"{path} takes 1..8 tokens")
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m)
    meta = build_meta(mapping, 4)
    # Chained, the shrink starts under the poisoning fill just before it (which writes `out`).
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path, chain_pdl=chain)
    assert not torch.isnan(y).any()
    # bf16 output and bf16 h in the epilogue (as vLLM's expand): well under 1e-2 relative.
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m,path", [(1, "decode"), (16, "decode"), (32, "decode"), pytest.param(40, "decode", marks=WIDE),
                                    pytest.param(64, "decode", marks=WIDE),
                                    (1, "decode_sq"), (8, "decode_sq"), (1, "decode_fh"), (8, "decode_fh")])
def test_pdl_off_is_identical_and_runs_are_bitwise_reproducible(m, path):
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=100 + m)
    meta = build_meta(mapping, 4)
    y0 = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path, pdl=True).clone()
    for _ in range(10):
        assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path, pdl=True), y0)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path, pdl=False), y0)
    for _ in range(10):  # back to back, each chained onto the previous K2 (one sync buffer)
        assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path, chain_pdl=True), y0)


@pytest.mark.parametrize("m", [16, pytest.param(40, marks=WIDE)])
@pytest.mark.parametrize("chain", [False, True])
def test_no_adapter_path_is_the_base_gemm(chain, m):
    widths, k = QWEN3_8B["down"]
    x, wq, ws, a, b, _ = _case(widths, k, m, seed=7)
    mapping = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    meta = build_meta(mapping, 4)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="no_adapter", chain_pdl=chain)
    ref = _reference(x, wq, ws, a, b, mapping)
    assert not torch.isnan(y).any() and _rel_err(y, ref) < 5e-3
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="no_adapter", chain_pdl=not chain), y)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode"),
                       ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="decode"))


@pytest.mark.parametrize("path,m", [("decode", 8), ("decode_sq", 8), ("decode_fh", 8),
                                    pytest.param("decode", 48, marks=WIDE)])
def test_decode_path_in_a_cuda_graph_with_new_inputs(path, m):
    widths, k = QWEN3_8B["gate_up"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=9)
    meta = build_meta(mapping, 4, m)
    out = torch.empty(m, sum(widths), dtype=torch.bfloat16, device="cuda")
    ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)  # load modules eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)
    for seed in (10, 11):
        x2, _, _, _, _, mapping2 = _case(widths, k, m, seed=seed)
        x.copy_(x2)
        meta.prepare(mapping2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(x, wq, ws, a, b, mapping2)) < 1e-2


# Back-to-back projections (a decoder layer and a bit), each input the previous output where the
# shapes allow it: (projection, path, index of the step whose output is x, or None for a fresh x).
# decode_sq (1..8 tokens; "decode" at more) after decode, after itself and before decode.
CHAIN = [("o", "decode", None), ("qkv", "decode", 0), ("gate_up", "decode", 0), ("down", "decode", None),
         ("o", "no_adapter", 3), ("qkv", "decode", 4), ("o", "no_adapter", 4), ("o", "decode", 6),
         ("o", "decode_sq", 7), ("qkv", "decode_sq", 8), ("o", "decode", 8), ("gate_up", "decode_sq", 10),
         ("o", "decode_sq", 10), ("down", "decode_sq", None), ("o", "decode_fh", 12), ("qkv", "decode_fh", 14),
         ("gate_up", "decode_fh", 14), ("down", "decode", None), ("o", "decode_fh", 14), ("o", "decode_sq", 18),
         ("qkv", "decode_fh", 19)]


class _Chain:
    """Weights and adapters per projection, fresh inputs, and one output buffer per step and round."""

    def __init__(self, m: int, rounds: int):
        self.m, self.rounds = m, rounds
        self.w = {}
        for i, proj in enumerate(QWEN3_8B):
            widths, k = QWEN3_8B[proj]
            x, wq, ws, a, b, mapping = _case(widths, k, m, seed=300 + 10 * m + i)
            self.w[proj] = (x, wq, ws, a, b, mapping, build_meta(mapping, 4))
        none = torch.full((m,), -1, dtype=torch.int32, device="cuda")
        self.none = (none, build_meta(none, 4))

    def outputs(self):
        return [[torch.full((self.m, self.w[p][1].shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
                 for p, _, _ in CHAIN] for _ in range(self.rounds)]

    def step(self, i: int, outs, chain: bool, prefetch_bytes: int = 0):
        """Step i of CHAIN; with prefetch_bytes, followed by prefetch_l2 of the next step's weight
        (as the plugin's layers do with EPILORA_L2_PREFETCH)."""
        proj, path, src = CHAIN[i]
        x, wq, ws, a, b, mapping, meta = self.w[proj]
        if src is not None:
            x = outs[src]
        if path == "no_adapter":
            mapping, meta = self.none
        if path in ("decode_sq", "decode_fh") and self.m > 8:
            path = "decode"
        y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=outs[i], path=path, chain_pdl=chain)
        if prefetch_bytes:
            from epilora_cute.prefetch import prefetch_l2

            prefetch_l2(self.w[CHAIN[(i + 1) % len(CHAIN)][0]][1], prefetch_bytes)
        return x, mapping, y

    def assert_replay_equals_plain(self, graph, outs, seed: int):
        """New inputs (seeded), outputs poisoned, the captured sequence replayed: its outputs are the
        bits of the eager unchained run on the same inputs."""
        for i, proj in enumerate(QWEN3_8B):
            widths, k = QWEN3_8B[proj]
            self.w[proj][0].copy_(_case(widths, k, self.m, seed=seed + i)[0])
        for y in outs[0]:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _, plain = self.run(chain=False)
        for i in range(len(CHAIN)):
            assert torch.equal(outs[0][i], plain[0][i]), (seed, i, CHAIN[i])

    def run(self, chain: bool, prefetch_bytes: int = 0):
        """Every round's steps back to back: no other kernel in between (outputs poisoned first)."""
        outs = self.outputs()
        inputs = [[self.step(i, o, chain, prefetch_bytes)[0] for i in range(len(CHAIN))] for o in outs]
        torch.cuda.synchronize()
        return inputs, outs


@pytest.mark.parametrize("m", [1, 8, 32, pytest.param(48, marks=WIDE)])
def test_chained_projections_back_to_back(m):
    """Different projections back to back on one stream, each chained onto the previous one's K2
    (decode after decode, no-adapter after decode and the reverse; one sync buffer), reading the
    previous outputs as inputs: each step matches the reference on its input, and the bits are
    those of the unchained run."""
    c = _Chain(m, rounds=3)
    c.run(chain=True)  # the cached device tensors are made (a call that makes one is not chained)
    inputs, outs = c.run(chain=True)
    for r in range(c.rounds):
        for i, (proj, path, _) in enumerate(CHAIN):
            _, wq, ws, a, b, mapping, _ = c.w[proj]
            if path == "no_adapter":
                mapping = c.none[0]
            y = outs[r][i]
            assert not torch.isnan(y).any(), (r, i, proj, path)
            err = _rel_err(y, _reference(inputs[r][i], wq, ws, a, b, mapping))
            assert err < (5e-3 if path == "no_adapter" else 1e-2), (r, i, proj, path, err)
    _, plain = c.run(chain=False)
    for r in range(c.rounds):
        for i in range(len(CHAIN)):
            assert torch.equal(outs[r][i], plain[r][i]), (r, i, CHAIN[i])


def test_chained_projections_in_a_cuda_graph():
    """The chained sequence captured once (PDL edges inside the graph), replayed with new inputs:
    the bits of the eager unchained run on the same inputs."""
    c = _Chain(8, rounds=1)
    c.run(chain=True)  # load modules and make the cached tensors outside capture
    outs = c.outputs()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(CHAIN)):
            c.step(i, outs[0], chain=True)
    for seed in (21, 22):
        c.assert_replay_equals_plain(g, outs, seed)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_xgate_chain_is_the_unchained_bits(m, monkeypatch):
    """v1.03 (EPILORA_K2_XGATE=1): the chained decode_sq steps of CHAIN take the x-gated pair (K2
    launched under the kernel before its shrink, reading x only past the gate), between decode,
    no-adapter and decode_fh steps and after each other, each reading an earlier step's output:
    the bits of the unchained run, round after round; both halves of the gate buffer re-armed."""
    from kernels_dsl import k2_gemm

    monkeypatch.setenv(k2_gemm.XGATE_ENV, "1")
    c = _Chain(m, rounds=3)
    c.run(chain=True)  # the cached device tensors, the gate buffer included, are made
    for _ in range(3):
        _, outs = c.run(chain=True)
        _, plain = c.run(chain=False)
        for r in range(c.rounds):
            for i in range(len(CHAIN)):
                assert not torch.isnan(outs[r][i]).any(), (r, i, CHAIN[i])
                assert torch.equal(outs[r][i], plain[r][i]), (r, i, CHAIN[i])
    assert not ops._xgate_buffer(torch.device("cuda")).any()


def test_xgate_chain_in_a_cuda_graph(monkeypatch):
    """The x-gated chain captured once (the halves the calls took recorded in the graph), replayed
    with new inputs: the bits of the eager unchained run; the gate buffer re-armed after each replay."""
    from kernels_dsl import k2_gemm

    monkeypatch.setenv(k2_gemm.XGATE_ENV, "1")
    c = _Chain(4, rounds=1)
    c.run(chain=True)
    outs = c.outputs()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(CHAIN)):
            c.step(i, outs[0], chain=True)
    for seed in (31, 32, 33):
        c.assert_replay_equals_plain(g, outs, seed)
        assert not ops._xgate_buffer(torch.device("cuda")).any()


@pytest.mark.parametrize("m", [1, 8])
def test_xgate_same_projection_back_to_back(m, monkeypatch):
    """One projection (o) chained onto itself 12 times, each call's x the previous call's y: the
    shortest distance between x-gated K2s on the same stream (the halves alternate), bit for bit
    the unchained sequence."""
    from kernels_dsl import k2_gemm

    monkeypatch.setenv(k2_gemm.XGATE_ENV, "1")
    widths, k = QWEN3_8B["o"]
    x0, wq, ws, a, b, mapping = _case(widths, k, m, seed=77)
    meta = build_meta(mapping, 4)

    def seq(chain: bool):
        ys, x = [], x0
        for _ in range(12):
            y = torch.full((m, wq.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
            x = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=y, path="decode_sq", chain_pdl=chain)
            ys.append(x)
        torch.cuda.synchronize()
        return ys

    seq(True)
    gated, plain = seq(True), seq(False)
    assert all(torch.equal(p, q) for p, q in zip(gated, plain))
    assert not ops._xgate_buffer(torch.device("cuda")).any()


@pytest.mark.parametrize("m", [65, 100, 511])
def test_auto_above_decode_sizes_takes_the_triton_path(m):
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m)
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4))
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [1, 512])
def test_auto_settled_answer_is_the_decided_path(m, tmp_path):
    """path="auto" with a fresh dispatcher: the first eager call times the candidates and decides;
    the next calls take the remembered answer (dispatch.auto_path's settled memo) and write the
    decided path's result bit for bit into a poisoned output."""
    from epilora_cute import dispatch

    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 5)
    meta = build_meta(mapping, 4)
    saved = dispatch._default
    dispatch.set_dispatcher(dispatch.Dispatcher(dispatch.DispatchTable(tmp_path / "dispatch.json")))
    try:
        first = ops.lora_linear_fp8(x, wq, ws, a, b, meta).clone()
        d = dispatch.dispatcher()
        assert len(d.settled) == 1
        (path,) = d.settled.values()
        out = torch.full_like(first, float("nan"))
        again = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out)
        assert again is out and len(d.settled) == 1
        explicit = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path)
    finally:
        dispatch.set_dispatcher(saved)
    assert torch.equal(again, first) and torch.equal(explicit, first), path
    assert _rel_err(first, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [33, 512])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_eager_memo_replays_the_hybrid_path_bit_for_bit(proj, m, tmp_path, monkeypatch):
    """v1.02 (epilora_cute/eager_memo.py): an eager "auto" call settled on the hybrid path (forced
    here) is replayed from the dispatcher's memo: into a poisoned output, bit for bit the explicit
    hybrid path's y, with new activations too."""
    from epilora_cute import dispatch

    monkeypatch.setenv(dispatch.FORCE_ENV, "hybrid")
    asked, real_auto = [], dispatch.auto_path
    monkeypatch.setattr(dispatch, "auto_path", lambda *a, **kw: asked.append(1) or real_auto(*a, **kw))
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 9)
    meta = build_meta(mapping, 4)
    x2 = torch.randn_like(x)
    saved = dispatch._default
    dispatch.set_dispatcher(dispatch.Dispatcher(dispatch.DispatchTable(tmp_path / "dispatch.json")))
    try:
        explicit = [ops.lora_linear_fp8(xi, wq, ws, a, b, meta, path="hybrid") for xi in (x, x2)]
        ops.lora_linear_fp8(x, wq, ws, a, b, meta)  # settles the call and leaves the memo's entry
        assert len(dispatch.dispatcher().eager_plans) == 1
        replayed = []
        for xi in (x, x2):
            out = torch.full_like(explicit[0], float("nan"))
            assert ops.lora_linear_fp8(xi, wq, ws, a, b, meta, out=out) is out
            replayed.append(out)
        assert len(asked) == 1  # the dispatch was asked once, by the settling call
    finally:
        dispatch.set_dispatcher(saved)
    assert all(torch.equal(r, e) for r, e in zip(replayed, explicit))
    assert _rel_err(replayed[0], _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [33, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_hybrid_path_matches_reference(proj, m):
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 1)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4), out=out, path="hybrid")
    assert not torch.isnan(y).any()
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("stream_priority", [False, True], indirect=True)
@pytest.mark.parametrize("path", ["hybrid_par", "hybrid_par_q"])
@pytest.mark.parametrize("m", [1, 33, 64, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "o", "down"])
def test_hybrid_par_is_the_hybrid_path_bit_for_bit(proj, m, path, stream_priority):
    """hybrid_par (K1 on a second stream beside the quantization + GEMM) and hybrid_par_q (that
    branch forked after the quantization) return the hybrid path's y bit for bit (the same codes,
    GEMM and h), into a poisoned output, and match the reference; with the quantization + GEMM on
    the high-priority stream (v0.91) as without."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 11)
    meta = build_meta(mapping, 4)
    want = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="hybrid")
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, want)
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("path", ["hybrid", "hybrid_par", "hybrid_par_q"])
@pytest.mark.parametrize("m", [33, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "gate_up", "down"])
def test_hybrid_paths_with_bf16_h_are_bit_for_bit_fp32_h(proj, m, path, monkeypatch):
    """v0.71: EPILORA_HYBRID_H=bf16 (K1 stores h as bf16, the expand-add reads it as it is) gives
    the fp32-h path's y bit for bit, into a poisoned output."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 23)
    meta = build_meta(mapping, 4)
    try:
        monkeypatch.setenv(ops.HYBRID_H_ENV, "fp32")
        ops.hybrid_h_dtype.cache_clear()
        want = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path)
        monkeypatch.setenv(ops.HYBRID_H_ENV, "bf16")
        ops.hybrid_h_dtype.cache_clear()
        out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)
        torch.cuda.synchronize()
    finally:
        ops.hybrid_h_dtype.cache_clear()
    assert y.data_ptr() == out.data_ptr() and torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("stream_priority", [False, True], indirect=True)
@pytest.mark.parametrize("path,m,serial", [("hybrid_par", 64, "hybrid"), ("hybrid_par_q", 64, "hybrid"),
                                           ("hybrid_par_st", 1024, "hybrid_st"), ("hybrid_par_g", 256, "hybrid_g")])
def test_hybrid_par_in_a_cuda_graph_with_new_inputs(path, m, serial, stream_priority):
    """The fork / join is captured as two branches of one graph (three with v0.91's high-priority
    stream); replays with new x and a new adapter mapping match the eager serial form of the path
    bit for bit; the streams are joined (the capture would fail otherwise) and the output is
    written once per replay."""
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=31)
    meta = build_meta(mapping, 4, m)
    out = torch.empty(m, sum(widths), dtype=torch.bfloat16, device="cuda")
    ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)  # load modules eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path)
    for seed in (32, 33):
        x2, _, _, _, _, mapping2 = _case(widths, k, m, seed=seed)
        x.copy_(x2)
        meta.prepare(mapping2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=serial))


@pytest.mark.parametrize("m", [1, 33, 1024, 2048, 4100])
@pytest.mark.parametrize("proj", list(QWEN3_8B))
def test_stream_paths_match_reference(proj, m):
    """v0.88: the hybrid paths with the streamed shrink (quantization kernel + vendor GEMM, the
    streamed shrink, expand-add), serial and on the second stream, into a poisoned output: the
    two bit for bit each other (same codes, GEMM and h) and the reference within tolerance."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 61)
    _assert_serial_and_par_agree(ops.STREAM_PATHS, x, wq, ws, a, b, build_meta(mapping, 4), mapping)


@pytest.mark.parametrize("path,m", [("hybrid_par_st", 33), ("hybrid_par_st", 2048), ("hybrid_par_g", 64),
                                    ("hybrid_par_g", 256)])
@pytest.mark.parametrize("proj", ["qkv", "gate_up"])
def test_side_shrink_par_paths_with_stream_priority_bit_for_bit(proj, path, m):
    """v0.91: hybrid_par_st / hybrid_par_g with the quantization + GEMM on the high-priority stream
    write the same y, bit for bit, as with everything on the caller's stream, into a poisoned output."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 71)
    meta = build_meta(mapping, 4)
    ys = []
    for priority in (False, True):
        before = ops.set_stream_priority(priority)
        try:
            out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
            ys.append(ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path))
        finally:
            ops.set_stream_priority(before)
    torch.cuda.synchronize()
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
    assert _rel_err(ys[1], _reference(x, wq, ws, a, b, mapping)) < 1e-2


def _assert_serial_and_par_agree(paths, x, wq, ws, a, b, meta, mapping):
    """The serial and the second-stream form of a hybrid path, each into a poisoned output it
    writes in place: bit for bit each other (same codes, GEMM and h) and the reference within
    tolerance."""
    ys = []
    for path in paths:
        out = torch.full((x.shape[0], wq.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda")
        ys.append(ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path=path))
        assert ys[-1].data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
    assert _rel_err(ys[0], _reference(x, wq, ws, a, b, mapping)) < 1e-2


def _mixed_rank_slots(a, b, k, loras=32):
    """Effective ranks 0 / 16 / 40 / 64 over the slots (slot_ranks), the buffers zeroed beyond each
    slot's rank as vLLM pads them (work beyond it is skipped)."""
    ranks = torch.tensor([(0, 16, 40, 64)[i % 4] for i in range(loras)], dtype=torch.int32, device="cuda")
    for t in (*a, *b):
        for lid, r in enumerate(ranks.tolist()):
            if t.shape[-2] == 64 and t.shape[-1] == k:
                t[lid, :, r:] = 0
            else:
                t[lid, :, :, r:] = 0
    return ranks


@pytest.mark.parametrize("path", ["hybrid_st", "hybrid_par_st"])
def test_stream_paths_mixed_ranks_and_many_adapters(path):
    """32 adapter slots, effective ranks 0 / 16 / 40 / 64 (slot_ranks), tokens without adapter."""
    widths, k = QWEN3_8B["gate_up"]
    m = 2048
    x, wq, ws, a, b, mapping = _case(widths, k, m, loras=32, adapters=32, seed=71)
    ranks = _mixed_rank_slots(a, b, k)
    meta = build_meta(mapping, 32)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, slot_ranks=ranks, path=path)
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2


def test_stream_paths_without_adapters_are_vllms_fp8_path():
    widths, k = QWEN3_8B["qkv"]
    m = 2048
    x, wq, ws, a, b, _ = _case(widths, k, m, seed=91)
    meta = build_meta(torch.full((m,), -1, dtype=torch.int32, device="cuda"), 4)
    want = ops.base_linear_fp8(x, wq, ws)
    for path in ops.STREAM_PATHS:
        # not known on the host: the kernels run over zero adapters (h = 0, nothing added)
        assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path), want)
    meta.host_num_adapters = 0  # vLLM's no-LoRA flag: vLLM's FP8 path, no shrink or expand-add
    for path in ops.STREAM_PATHS:
        assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path), want)


@pytest.mark.parametrize("m,loras", [(1, 4), (33, 4), (64, 8), (256, 32), (511, 32), (300, 3)])
@pytest.mark.parametrize("proj", list(QWEN3_8B))
def test_grouped_paths_match_reference(proj, m, loras):
    """v0.90: the hybrid paths with the shrink by adapter group (quantization kernel + vendor GEMM,
    the grouped shrink, expand-add), serial and on the second stream, into a poisoned output: the
    two bit for bit each other and the reference within tolerance; many adapters of few tokens."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, loras=loras, adapters=loras, seed=m + 67)
    _assert_serial_and_par_agree(ops.GROUPED_PATHS, x, wq, ws, a, b, build_meta(mapping, loras), mapping)


@pytest.mark.parametrize("path", ["hybrid_g", "hybrid_par_g"])
def test_grouped_paths_mixed_ranks_and_no_adapters(path):
    """32 adapter slots, effective ranks 0 / 16 / 40 / 64 (slot_ranks), tokens without adapter;
    then a batch without adapters (not known on the host, then known: vLLM's FP8 path)."""
    widths, k = QWEN3_8B["gate_up"]
    m = 256
    x, wq, ws, a, b, mapping = _case(widths, k, m, loras=32, adapters=32, seed=73)
    ranks = _mixed_rank_slots(a, b, k)
    meta = build_meta(mapping, 32)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, slot_ranks=ranks, path=path)
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2
    meta = build_meta(torch.full((m,), -1, dtype=torch.int32, device="cuda"), 32)
    want = ops.base_linear_fp8(x, wq, ws)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path), want)
    meta.host_num_adapters = 0
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path), want)


@pytest.mark.parametrize("path", ["hybrid", "hybrid_par", "hybrid_par_q"])
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_hybrid_paths_through_launch_plans_are_the_family_entries_bit_for_bit(proj, m, path):
    """Calls after the first with the same adapter buffers and metadata launch K1 and the
    expand-add through launch plans (epilora_cute/launch_plans.py): with new activations each
    call, y is bit for bit what a call without plans (the families' own entries) computes."""
    from epilora_cute import launch_plans

    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 41)
    meta = build_meta(mapping, 4)
    launch_plans.clear()
    ops.lora_linear_fp8(x, wq, ws, a, b, meta, path=path)  # the families' entries; plans made
    assert len(launch_plans._k1_plans) and len(launch_plans._expand_plans)
    for seed in (42, 43):
        x2 = _case(widths, k, m, seed=seed)[0]
        out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
        planned = ops.lora_linear_fp8(x2, wq, ws, a, b, meta, out=out, path=path)
        launch_plans.clear()
        cold = ops.lora_linear_fp8(x2, wq, ws, a, b, meta, path=path)
        torch.cuda.synchronize()
        assert planned.data_ptr() == out.data_ptr() and torch.equal(planned.view(torch.int16), cold.view(torch.int16))
        assert _rel_err(planned, _reference(x2, wq, ws, a, b, mapping)) < 1e-2


@pytest.mark.parametrize("m", [1, 33, 2048])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_hybrid_path_without_adapters_is_vllms_fp8_path(proj, m):
    """No token has an adapter and the host knows it (vLLM's no-LoRA flag -> host_num_adapters
    0): the hybrid path is exactly the quantization + the vendor GEMM, bit for bit, and within
    the reference's tolerance; no K1 or expand-add runs over zero adapters."""
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, _ = _case(widths, k, m, seed=m + 5)
    mapping = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    meta = build_meta(mapping, 4)
    meta.host_num_adapters = 0  # what the plugin sets from vLLM's no-LoRA flag (a CUDA mapping is not counted)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, out=out, path="hybrid")
    codes, scales = ops.quantize_fp8_per_token(x)
    assert torch.equal(y, ops.vendor_fp8_gemm(codes, scales, wq, ws))
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 5e-3
    # "base" is that path by name, and "auto" takes it for such a batch (EPILORA_NO_LORA_PATH unset).
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="base"), y)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta), y)
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, meta), y)  # its key known: the dispatch skipped
    # The plugin's direct entry for flagged batches (no metadata, no dispatch): the same bits.
    assert torch.equal(ops.base_linear_fp8(x, wq, ws), y)
    out2 = torch.full_like(out, float("nan"))
    assert ops.base_linear_fp8(x, wq, ws, out=out2) is out2 and torch.equal(out2, y)


@pytest.mark.parametrize("m", [33, 256, 2048])
@pytest.mark.parametrize("proj", ["qkv", "down"])
def test_prefill_path_matches_reference(proj, m):
    widths, k = QWEN3_8B[proj]
    x, wq, ws, a, b, mapping = _case(widths, k, m, seed=m + 2)
    out = torch.full((m, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4), out=out, path="prefill")
    assert not torch.isnan(y).any()
    assert _rel_err(y, _reference(x, wq, ws, a, b, mapping)) < 1e-2
    # Deterministic, and what the dispatch would run when it takes the path (opted in).
    assert torch.equal(ops.lora_linear_fp8(x, wq, ws, a, b, build_meta(mapping, 4), path="prefill"), y)


def test_prefill_path_without_adapters_is_vllms_fp8_path():
    widths, k = QWEN3_8B["qkv"]
    x, wq, ws, a, b, _ = _case(widths, k, 300, seed=11)
    meta = build_meta(torch.full((300,), -1, dtype=torch.int32, device="cuda"), 4)
    meta.host_num_adapters = 0
    codes, scales = ops.quantize_fp8_per_token(x)
    y = ops.lora_linear_fp8(x, wq, ws, a, b, meta, path="prefill")
    assert torch.equal(y, ops.vendor_fp8_gemm(codes, scales, wq, ws))


def test_vendor_gemm_is_the_base_gemm():
    widths, k = QWEN3_8B["o"]
    x, wq, ws, _, _, _ = _case(widths, k, 64, seed=3)
    codes, scales = ops.quantize_fp8_per_token(x)
    y = ops.vendor_fp8_gemm(codes, scales, wq, ws)
    assert _rel_err(y, reference.fp8_scaled_mm(codes, scales, wq, ws)) < 5e-3
