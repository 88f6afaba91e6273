"""Per-token FP8 e4m3 activation quantization, bit-identical to vLLM's CUDA kernel.

One CTA per token row. Each thread loads its share of the row with 16-byte vector loads into
registers, the CTA reduces the NaN-ignoring abs-max, thread 0 writes the scale, and every thread
quantizes its registers and stores 8 codes (8 bytes) per vector: the row is read once.

Semantics (epilora_cute/reference.py, ``quantize_fp8_per_token``):
  amax  = fmaxf-reduction of |x| from 0          (NaN ignored: fmax returns the non-NaN operand)
  scale = fmaxf(amax / 448, 1 / (448 * 512))     (IEEE fp32 division)
  code  = cvt.rn.satfinite.e4m3(fmaxf(-448, fminf(x / scale, 448)))   (NaN -> +448)

Compile-time configuration: threads per CTA and vectors (of 8 elements) per thread; the row
length K is a run-time value (multiple of 8) checked against the capacity by the caller.

PDL: every thread executes griddepcontrol.wait first (the kernel may be launched with PDL behind
the previous projection's K2, ops.lora_linear_fp8(chain_pdl=True)), then
griddepcontrol.launch_dependents (for K2 without adapter, launched with PDL behind it). Nothing
is read before the wait, so chaining this kernel assumes nothing about its predecessor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from epilora_cute.kernel_abi import TensorParam

try:  # the DSL is needed to compile, not to launch a cached build
    import cutlass
    import cutlass.cute as cute

    from ._dsl import FP8_MAX, MIN_SCALE  # vLLM's constants, shared by every quantizing kernel
    from ._dsl import smem_allocator
except ImportError:  # pragma: no cover - exercised on GPU machines without the DSL
    cutlass = cute = None

FAMILY = "fp8_quant"
ELEMS_PER_VECTOR = 8  # 8 bf16 = one 16-byte load


@dataclass(frozen=True)
class Config:
    threads: int = 256
    vectors_per_thread: int = 2

    @property
    def capacity(self) -> int:
        """The longest row (elements) one CTA quantizes from registers."""
        return self.threads * self.vectors_per_thread * ELEMS_PER_VECTOR

    def name(self) -> str:
        return f"t{self.threads}_v{self.vectors_per_thread}"

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @functools.cached_property  # launches ask for it on every call
    def smem_bytes(self) -> int:
        return 4 * (self.threads // 32)  # one fp32 partial max per warp


# Launch-order parameters; the dynamic modes match the fake tensors in ``compile``.
PARAMS = (
    TensorParam("x", torch.bfloat16, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),
    TensorParam("codes", torch.float8_e4m3fn, 2, dynamic_shape=(0, 1), dynamic_stride=(0,), align=16),
    TensorParam("scales", torch.float32, 2, dynamic_shape=(0,), align=4),
)


@functools.lru_cache(maxsize=None)  # a pure function of k, asked on every launch
def config_for(k: int) -> Config:
    """The configuration that covers a row of k elements (k % 8 == 0) with the fewest idle slots.

    Measured on the H200 (docs/perf.md, run 1): the time of large batches tracks the fraction of
    thread slots left idle by the last vector (0 % idle: 0.92x vLLM's time, 20 %: 1.12x), so the
    thread count is any multiple of 32 that makes threads * vectors fit k tightly.
    """
    nvec = -(-k // ELEMS_PER_VECTOR)
    best = None
    for v in range(1, 9):
        threads = max(64, (-(-nvec // v) + 31) // 32 * 32)
        if threads > 1024:
            continue
        idle = threads * v - nvec
        # Fewest idle slots; then CTAs near 256 threads (the zero-waste shapes measured fast).
        key = (idle / (threads * v) > 0.04, idle, abs(threads - 256), v)
        if best is None or key < best[0]:
            best = (key, Config(threads=threads, vectors_per_thread=v))
    if best is None:
        raise ValueError(f"rows of {k} elements exceed the kernel's capacity of {MAX_K}")
    return best[1]


MAX_K = 1024 * 8 * 8


def prebuild_configs() -> list[Config]:
    """Every configuration ``config_for`` can return for the hidden sizes we serve."""
    ks = [8, 24, 64, 256, 1024, 2048, 3584, 4096, 5120, 6144, 7168, 8192, 8208, 12288, 14336, 14784, 16384, 25600,
          27648, 29568, 6400, 13824, 3072, 1536]
    return sorted({config_for(k) for k in ks}, key=lambda c: (c.threads, c.vectors_per_thread))


if cute is not None:  # the kernel itself exists only where the DSL is importable

    class _QuantKernel:
        def __init__(self, config: Config):
            self.cfg = config
            self.num_warps = config.threads // 32

        @cute.jit
        def __call__(self, m_x: cute.Tensor, m_q: cute.Tensor, m_scale: cute.Tensor, stream):
            rows = m_x.shape[0]
            self.kernel(m_x, m_q, m_scale).launch(grid=[rows, 1, 1], block=[self.cfg.threads, 1, 1],
                                                  smem=self.cfg.smem_bytes, stream=stream)

        @cute.jit
        def _block_max(self, val: cutlass.Float32, red: cute.Tensor, tidx):
            for i in cutlass.range_constexpr(5):
                val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=1 << i))
            warp, lane = tidx // 32, tidx % 32
            if lane == 0:
                red[warp] = val
            cute.arch.sync_threads()
            val = cutlass.Float32(0.0)
            for w in cutlass.range_constexpr(self.num_warps):
                val = cute.arch.fmax(val, red[w])
            return val

        @cute.kernel
        def kernel(self, m_x: cute.Tensor, m_q: cute.Tensor, m_scale: cute.Tensor):
            # Launched with PDL when chained behind the previous projection's K2: x may be its
            # output, and the codes/scales buffers may still be read by it. Wait for it, then let
            # our PDL dependent (K2 without adapter) be scheduled: it streams its first weight
            # stages and executes griddepcontrol.wait before it reads x_q / s_x. Triggering only
            # after the wait keeps the overlap one kernel deep. (No-op wait without PDL.)
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            k = m_x.shape[1]
            V = self.cfg.vectors_per_thread
            E = ELEMS_PER_VECTOR
            T = self.cfg.threads

            # Row views tiled in 8-element vectors: g_x[(e), j] is element e of vector j.
            g_x = cute.zipped_divide(m_x[row, None], (E,))
            g_q = cute.zipped_divide(m_q[row, None], (E,))
            r_x = cute.make_rmem_tensor(cute.make_layout((E, V)), m_x.element_type)
            r_x.fill(0)
            for i in cutlass.range_constexpr(V):
                j = i * T + tidx
                if j * E < k:
                    cute.autovec_copy(g_x[None, j], r_x[None, i])

            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(V):
                for e in cutlass.range_constexpr(E):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(r_x[e, i].to(cutlass.Float32),
                                                               -r_x[e, i].to(cutlass.Float32)))
            smem = smem_allocator()
            red = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.num_warps))
            amax = self._block_max(amax, red, tidx)

            scale = cute.arch.fmax(amax / cutlass.Float32(FP8_MAX), cutlass.Float32(MIN_SCALE))
            if tidx == 0:
                m_scale[row, 0] = scale

            r_q = cute.make_rmem_tensor(cute.make_layout((E, V)), m_q.element_type)
            for i in cutlass.range_constexpr(V):
                for e in cutlass.range_constexpr(E):
                    q = r_x[e, i].to(cutlass.Float32) / scale
                    q = cute.arch.fmax(cutlass.Float32(-FP8_MAX), cute.arch.fmin(q, cutlass.Float32(FP8_MAX)))
                    r_q[e, i] = q.to(m_q.element_type)
            for i in cutlass.range_constexpr(V):
                j = i * T + tidx
                if j * E < k:
                    cute.autovec_copy(r_q[None, i], g_q[None, j])


def compile(config: Config, options: str):
    """Compile for the target in ``options`` from fake tensors (no GPU needed).

    Tensors: x [M, K] bf16 row-major (row stride dynamic, 16-byte aligned), q [M, K] e4m3
    row-major, scale [M, 1] fp32. M, K and the row strides are run-time values.
    """
    m = cute.sym_int32()
    k = cute.sym_int32(divisibility=ELEMS_PER_VECTOR)
    sx = cute.sym_int64(divisibility=ELEMS_PER_VECTOR)
    sq = cute.sym_int64(divisibility=ELEMS_PER_VECTOR)
    fake = cute.runtime.make_fake_tensor
    x = fake(cutlass.BFloat16, (m, k), stride=(sx, 1), assumed_align=16)
    q = fake(cutlass.Float8E4M3FN, (m, k), stride=(sq, 1), assumed_align=16)
    s = fake(cutlass.Float32, (m, 1), stride=(1, 1), assumed_align=4)
    stream = cute.runtime.make_fake_stream()
    return cute.compile(_QuantKernel(config), x, q, s, stream, options=options)
