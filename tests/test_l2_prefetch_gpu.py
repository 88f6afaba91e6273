"""The L2 prefetch on the GPU (docs/perf.md v0.77): it runs on every byte range the plan makes and
changes no result, also between chained projections (PDL: the next projection's kernel is the
prefetch kernel's dependent) and inside a CUDA graph."""

import pytest
import torch

from epilora_cute import prefetch
from kernels_dsl import l2_prefetch
from tests.test_lora_linear_gpu import CHAIN, _Chain

pytestmark = pytest.mark.gpu

MB = 1 << 20


@pytest.mark.parametrize("nbytes", [16, 4096, 4112, MB + 48, 25 * MB, None])
def test_prefetch_runs_on_every_planned_range_and_touches_nothing(nbytes):
    w = torch.randint(0, 255, (6144, 4096), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    before = w.view(torch.uint8).clone()
    want = min(nbytes or w.numel(), w.numel())
    assert prefetch.prefetch_l2(w.t(), nbytes) == want  # vLLM's weight view ([K, N] storage)
    assert prefetch.prefetch_l2(w, nbytes, pdl=False) == want
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas, _ = l2_prefetch.plan_segments(want, sms)
    assert ctas <= sms


@pytest.mark.parametrize("m", [1, 8, 32])
def test_chained_projections_with_prefetches_between_them(m):
    """CHAIN's projections back to back, each followed by a prefetch of the next one's weight and
    the next one chained onto that prefetch kernel: the bits of the plain unchained run."""
    c = _Chain(m, rounds=2)
    c.run(chain=True, prefetch_bytes=8 * MB)  # the cached device tensors are made
    _, outs = c.run(chain=True, prefetch_bytes=8 * MB)
    _, plain = c.run(chain=False)
    for r in range(c.rounds):
        for i in range(len(CHAIN)):
            assert not torch.isnan(outs[r][i]).any(), (r, i, CHAIN[i])
            assert torch.equal(outs[r][i], plain[r][i]), (r, i, CHAIN[i])


def test_prefetches_in_a_cuda_graph():
    c = _Chain(4, rounds=1)
    c.run(chain=True, prefetch_bytes=32 * MB)
    outs = c.outputs()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(CHAIN)):
            c.step(i, outs[0], chain=True, prefetch_bytes=32 * MB)
    for seed in (31, 32):
        c.assert_replay_equals_plain(g, outs, seed)


def test_beside_prefetches_in_a_cuda_graph():
    """v0.80: each projection's next weight prefetched on a second stream (forked after the
    projection, joined before the next one, all joined before the capture ends): the capture
    completes and replays the plain run's bits, eagerly too."""
    c = _Chain(4, rounds=1)
    c.run(chain=True)
    beside = prefetch.BesidePrefetch()

    def steps(outs):
        for i in range(len(CHAIN)):
            beside.join()
            c.step(i, outs, chain=True)
            assert beside.launch(c.w[CHAIN[(i + 1) % len(CHAIN)][0]][1], 16 * MB) > 0
        beside.join()
        assert beside.pending == 0

    outs = c.outputs()
    steps(outs[0])  # eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        steps(outs[0])
    for seed in (41, 42):
        c.assert_replay_equals_plain(g, outs, seed)
