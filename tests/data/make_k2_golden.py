"""Regenerate k2_tma_golden.json: the TMA descriptors the DSL's own host code builds (captured
with stub CUDA functions, kernels_dsl.host_capture) for a few K2/shrink configurations and shapes.

    .venv/bin/python tests/data/make_k2_golden.py      (no GPU needed)
"""

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kernels_dsl import k2_gemm, lora_shrink  # noqa: E402
from kernels_dsl.host_capture import capture_in_subprocess  # noqa: E402
from test_k2_compile import BASE, _k2_values  # noqa: E402


def main():
    out = {"dsl_note": "first 64 bytes are meaningful; the DSL leaves bytes 64..127 uninitialised",
           "descriptors": []}
    import importlib.metadata

    out["dsl_version"] = importlib.metadata.version("nvidia-cutlass-dsl")
    cases = [  # (config, N, K, M, L, widths)
        (k2_gemm.Config(bn=16, lora=True, num_slices=3, rank=16), 6144, 4096, 5, 4, (4096, 1024, 1024)),
        (k2_gemm.Config(bn=32, lora=True, num_slices=2, rank=64), 24576, 4096, 32, 8, (12288, 12288)),
        (k2_gemm.Config(bm=64, bn=8, lora=True, num_slices=2, rank=32), 29568, 8192, 1, 2, (14784, 14784)),
        (k2_gemm.Config(bn=8, lora=True, num_slices=1, rank=256), 4096, 14784, 3, 2, (4096,)),
    ]
    for cfg, N, K, M, L, widths in cases:
        cap = capture_in_subprocess("kernels_dsl.k2_gemm", cfg, _k2_values(cfg, N, K, M, L, widths))
        names = [p.name for p in k2_gemm.params(cfg)]
        raw = dict(zip(names, cap["params"]))
        geo = {"tma_w": (N, K, K, BASE), "tma_xq": (M, K, K, BASE + 0x1000_0000)}
        for i, wd in enumerate(widths):
            geo[f"tma_b{i}"] = (L * wd, cfg.rank, cfg.rank, BASE + 0x6000_0000 + i * 0x100_0000)
        for name, (rows, cols, rs, addr) in geo.items():
            out["descriptors"].append(dict(family=k2_gemm.FAMILY, config=dataclasses.asdict(cfg), param=name,
                                           rows=rows, cols=cols, row_stride=rs, address=addr, dsl_bytes=raw[name]))
    for cfg, M, K, L in [(lora_shrink.Config(bn=8, rank=16, num_slices=2), 3, 4096, 4),
                         (lora_shrink.Config(bn=32, rank=128, num_slices=1), 32, 14784, 8)]:
        R = cfg.rank
        v = dict(x=dict(data=BASE, shapes=[M, K], strides=[K]),
                 h=dict(data=BASE + 0x5000_0000, shapes=[M], strides=[M * R]),
                 xq16=dict(data=BASE + 0x1000_0000, shapes=[M, K // 2], strides=[K // 2]),
                 sx=dict(data=BASE + 0x2000_0000, shapes=[M]), sync=dict(data=BASE + 0x4000_0000),
                 tok=dict(data=BASE + 0x5100_0000, shapes=[M]), active=dict(data=BASE + 0x5200_0000, shapes=[L + 1]),
                 num_active=dict(data=BASE + 0x5300_0000), slot_ranks=dict(data=BASE + 0x5400_0000, shapes=[L]))
        for i in range(cfg.num_slices):
            v[f"a{i}"] = dict(data=BASE + 0x6000_0000 + i * 0x100_0000, shapes=[L * R, K], strides=[K])
        cap = capture_in_subprocess("kernels_dsl.lora_shrink", cfg, v)
        raw = dict(zip([p.name for p in lora_shrink.params(cfg)], cap["params"]))
        geo = {"tma_x": (M, K, K, BASE)}
        for i in range(cfg.num_slices):
            geo[f"tma_a{i}"] = (L * R, K, K, BASE + 0x6000_0000 + i * 0x100_0000)
        for name, (rows, cols, rs, addr) in geo.items():
            out["descriptors"].append(dict(family=lora_shrink.FAMILY, config=dataclasses.asdict(cfg), param=name,
                                           rows=rows, cols=cols, row_stride=rs, address=addr, dsl_bytes=raw[name]))
    for d in out["descriptors"]:
        d["dsl_bytes"] = d["dsl_bytes"][:128]  # 64 meaningful bytes
    (Path(__file__).parent / "k2_tma_golden.json").write_text(json.dumps(out, indent=1))
    print(f"{len(out['descriptors'])} descriptors")


if __name__ == "__main__":
    main()
