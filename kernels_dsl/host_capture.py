"""Run the DSL's own host code on a machine without a GPU and record what it would launch.

The DSL's generated host function builds every TMA descriptor itself (it bit-packs the 128-byte
CUtensorMap inline; it does not call cuTensorMapEncodeTiled) and then calls cudaLaunchKernelEx.
We export it with `export_to_c`, link the object with stub CUDA runtime functions, call it with
fake device pointers and capture the launch: grid, block, dynamic smem, launch attributes and
every kernel parameter's bytes. The captured descriptors are the golden bytes the runtime's own
cuTensorMapEncodeTiled calls must reproduce (compared on a GPU by tests/test_k2_gpu.py); on this
machine tests/test_k2_compile.py decodes them to check the declared TmaSpec (dims, strides, box).

Needs CUTE_DSL_ARCH=sm_90a in the environment *before* cutlass is imported (export_to_c needs the
JIT engine built for the target); run it through `capture_in_subprocess`.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile

STUBS_C = r"""
#include <stdint.h>
#include <string.h>
typedef struct { unsigned x, y, z; } dim3_t;
typedef struct { unsigned id; unsigned pad; unsigned char val[64]; } attr_t;
typedef struct { dim3_t grid; dim3_t block; size_t smem; void *stream; attr_t *attrs; unsigned nattrs; } cfg_t;
int g_nparams = 0;
unsigned char g_params[64][128];
unsigned g_grid[3], g_block[3], g_nattrs;
size_t g_smem;
attr_t g_attrs[32];
int g_launched = 0;
char g_logbuf[4096]; char *g_log = g_logbuf; int g_logn = 0;
#include <stdio.h>
#define LOG(...) (g_logn += snprintf(g_logbuf + g_logn, sizeof(g_logbuf) - g_logn, __VA_ARGS__))
int _cudaLaunchKernelEx(const cfg_t *cfg, const void *func, void **args) {
  g_grid[0] = cfg->grid.x; g_grid[1] = cfg->grid.y; g_grid[2] = cfg->grid.z;
  g_block[0] = cfg->block.x; g_block[1] = cfg->block.y; g_block[2] = cfg->block.z;
  g_smem = cfg->smem; g_nattrs = cfg->nattrs;
  for (unsigned i = 0; i < cfg->nattrs && i < 32; i++) g_attrs[i] = cfg->attrs[i];
  for (int i = 0; i < g_nparams && i < 64; i++) memcpy(g_params[i], args[i], 128);
  g_launched++;
  return 0;
}
int _cudaLibraryLoadData(void **lib, ...) { LOG("libload;"); *lib = (void *)0x1000; return 0; }
int _cudaLibraryGetKernel(void **k, ...) { LOG("getkernel;"); *k = (void *)0x2000; return 0; }
int _cudaGetDevice(int *d) { LOG("getdev;"); *d = 0; return 0; }
int _cudaDeviceGetAttribute(int *v, int attr, int dev) { LOG("devattr %d;", attr); *v = 232448; return 0; }
int _cudaFuncSetAttribute(const void *f, int attr, int v) { LOG("funcattr %d=%d;", attr, v); return 0; }
int _cudaKernelSetAttributeForDevice(void *k, int attr, int v, int dev) { LOG("kattr %d=%d;", attr, v); return 0; }
int _cuKernelGetAttribute(int *v, int attr, void *k, int dev) { LOG("cukattr %d;", attr); *v = 0; return 0; }
"""


def _log(lib):
    return ctypes.c_char_p.in_dll(lib, "g_log").value

def _parse_header(h: str, prefix: str):
    structs = {}
    for m in re.finditer(r"typedef struct \{(.*?)\} (\w+);", h, re.S):
        fields = []
        for f in re.finditer(r"(\w+\s*\*?)\s*(\w+)(?:\[(\d+)\])?;", m.group(1)):
            fields.append((f.group(1).replace(" ", ""), f.group(2), int(f.group(3)) if f.group(3) else None))
        structs[m.group(2)] = fields
    wrapper = re.search(rf"cute_dsl_{prefix}_wrapper\((.*?)\)\s*\{{", h, re.S).group(1)
    args = [a.strip() for a in wrapper.split(",")][1:]  # drop the module
    ciface = re.search(r"void (_mlir_\w+_mlir_ciface_\w+)\(void \*\*args", h).group(1)
    return structs, args, ciface


_CT = {"void*": ctypes.c_void_p, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64}


def _ctype_struct(fields):
    fl = []
    for ty, name, n in fields:
        base = _CT[ty]
        fl.append((name, base * n if n else base))
    return type("S", (ctypes.Structure,), {"_fields_": fl})


def capture(compiled, n_params: int, values: dict, workdir: str):
    """Call the compiled host function with `values` ({arg name: dict(data=int, shapes=[...],
    strides=[...]) or int for Int32 scalars}); return the captured launch."""
    compiled.export_to_c(file_path=workdir, file_name="cap", function_prefix="cap")
    with open(os.path.join(workdir, "stubs.c"), "w") as f:
        f.write(STUBS_C)
    so = os.path.join(workdir, "cap.so")
    # -Bsymbolic: bind to our stubs, not to the DSL runtime library already loaded in this process.
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o", so, os.path.join(workdir, "cap.o"),
                    os.path.join(workdir, "stubs.c")], check=True)
    lib = ctypes.CDLL(so)
    structs, args, ciface = _parse_header(open(os.path.join(workdir, "cap.h")).read(), "cap")

    ret = ctypes.c_int32(0)
    libptr = ctypes.c_void_p(0)
    libpp = ctypes.pointer(libptr)
    init_args = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.pointer(libpp), ctypes.c_void_p),
                                      ctypes.cast(ctypes.pointer(ret), ctypes.c_void_p))
    lib._mlir_cap_cuda_init(init_args)
    if ret.value:
        raise RuntimeError(f"module init returned {ret.value}, log {_log(lib)}")
    dev = ctypes.c_int32(0)
    load_args = (ctypes.c_void_p * 3)(ctypes.cast(ctypes.pointer(libpp), ctypes.c_void_p),
                                      ctypes.cast(ctypes.pointer(dev), ctypes.c_void_p),
                                      ctypes.cast(ctypes.pointer(ret), ctypes.c_void_p))
    lib._mlir_cap_cuda_load_to_device(load_args)
    if ret.value:
        raise RuntimeError(f"module load returned {ret.value}, log {_log(lib)}")

    keep = []
    ptrs = []
    for a in args:
        ty, name = a.rsplit(" ", 1)
        name = name.lstrip("*")
        ty = ty.replace(" ", "").rstrip("*")
        if ty in structs:
            S = _ctype_struct(structs[ty])
            v = values[name]
            s = S()
            s.data = v["data"]
            if hasattr(s, "dynamic_shapes"):
                for i, x in enumerate(v.get("shapes", [])):
                    s.dynamic_shapes[i] = x
            if hasattr(s, "dynamic_strides"):
                for i, x in enumerate(v.get("strides", [])):
                    s.dynamic_strides[i] = x
        elif ty == "cudaStream_t":
            s = ctypes.c_void_p(0)
        elif ty == "int32_t":
            s = ctypes.c_int32(values[name])
        else:
            raise TypeError(f"unsupported host argument {a}")
        keep.append(s)
        ptrs.append(ctypes.cast(ctypes.pointer(s), ctypes.c_void_p))
    ptrs.append(ctypes.cast(ctypes.pointer(ret), ctypes.c_void_p))
    arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
    ctypes.c_int.in_dll(lib, "g_nparams").value = n_params
    getattr(lib, ciface)(arr, len(ptrs))
    if ctypes.c_int.in_dll(lib, "g_launched").value != 1:
        raise RuntimeError(f"the host function did not launch (returned {ret.value}, log {_log(lib)})")
    raw = (ctypes.c_ubyte * (64 * 128)).in_dll(lib, "g_params")
    params = [bytes(raw[i * 128:(i + 1) * 128]).hex() for i in range(n_params)]
    grid = list((ctypes.c_uint * 3).in_dll(lib, "g_grid"))
    block = list((ctypes.c_uint * 3).in_dll(lib, "g_block"))
    nattrs = ctypes.c_uint.in_dll(lib, "g_nattrs").value
    attrs_raw = (ctypes.c_ubyte * (32 * 72)).in_dll(lib, "g_attrs")
    attrs = []
    for i in range(nattrs):
        b = bytes(attrs_raw[i * 72:(i + 1) * 72])
        attrs.append(dict(id=int.from_bytes(b[:4], "little"), value=b[8:20].hex()))
    return dict(params=params, grid=grid, block=block, smem=ctypes.c_size_t.in_dll(lib, "g_smem").value,
                attrs=attrs, ret=ret.value, calls=_log(lib).decode())


def _main():
    """python -m kernels_dsl.host_capture FAMILY_MODULE CONFIG_JSON VALUES_JSON: prints JSON."""
    mod_name, cfg_json, values_json = sys.argv[1:4]
    import importlib

    mod = importlib.import_module(mod_name)
    cfg = mod.Config(**json.loads(cfg_json))
    values = json.loads(values_json)
    with tempfile.TemporaryDirectory() as d:
        f = mod.compile(cfg, f"--gpu-arch sm_90a --dump-dir {d}")
        out = capture(f, len(mod.params(cfg)), values, d)
    print("CAPTURE " + json.dumps(out))


def capture_in_subprocess(module: str, config, values: dict, python: str = sys.executable) -> dict:
    import dataclasses

    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([python, "-m", "kernels_dsl.host_capture", module,
                        json.dumps(dataclasses.asdict(config)), json.dumps(values)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    for line in r.stdout.splitlines():
        if line.startswith("CAPTURE "):
            return json.loads(line[8:])
    raise RuntimeError(f"capture failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


if __name__ == "__main__":
    _main()


# ---------------------------------------------------------------------------------------------
# Partial decoder of a rank-2 CUtensorMap as the DSL 4.6/4.8 host code packs it (first 64 bytes;
# the DSL leaves bytes 64..127 uninitialised). Fields identified by varying one input at a time:
#   q0 = global address; q1 bits 0..27 = flags (bits 8..11 dtype code, 13..14 swizzle enum,
#   bit 21 set when the tensor spans >= 128 KiB), q1 bits 32..63 = (stride of dim 1) >> 4;
#   q4 = (dim0 - 1) | (dim1 - 1) << 32; bytes 55, 56 = box0 - 1, box1 - 1.
# ---------------------------------------------------------------------------------------------

DSL_DTYPE_CODE = {"UINT8": 0, "BFLOAT16": 5}
SWIZZLE_CODE = {"NONE": 0, "32B": 1, "64B": 2, "128B": 3}


def decode_tensormap2d(hexstr: str) -> dict:
    b = bytes.fromhex(hexstr)
    q = [int.from_bytes(b[i * 8:(i + 1) * 8], "little") for i in range(8)]
    return dict(
        address=q[0],
        flags=q[1] & 0x0FFFFFFF,
        dtype_code=(q[1] >> 8) & 0xF,
        swizzle_code=(q[1] >> 13) & 0x3,
        stride1_bytes=((q[1] >> 32) & 0xFFFFFFFF) << 4,
        dims=((q[4] & 0xFFFFFFFF) + 1, (q[4] >> 32) + 1),
        box=(b[55] + 1, b[56] + 1),
    )
