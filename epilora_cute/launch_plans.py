"""Launch plans for the hybrid paths' eager calls: K1 and the expand-add with their long-lived
parameters packed once.

An eager projection on the hybrid paths (a prefill chunk outside CUDA graphs) spent most of its
host time checking and packing what is the same on every call of a layer: the adapter buffers,
the metadata's persistent tensors, the slot ranks, the flags (run35: one adapter's 512-token TTFT
1.46x stock's; `tools/host_cpu.py --paths plugin:hybrid`: 319 µs per call on the CPU here, K1's
wrapper 98 and the expand-add's 66 of it). The first call with a set of such objects goes through
the family's own entry (``k1_quant_shrink`` / ``expand_add``: every check, its error messages) and
leaves a plan (``launcher.LaunchPlan``) keyed by those objects' identity (``IdentityMemo``: a plan
is found only for the very objects it was made from, whose geometry never changes in place — the
assumption of ops' layer memo). Later calls check only what changes between calls (the
activations, the outputs, the token count) and write only those parameters. Anything unusual (a
forced configuration, sorted codes, a shape the plan does not cover) takes the family's entry.

The per-call checks and the parameter lists are the families' own (``check_x`` / ``outputs`` /
``static_params`` in k1_shrink, ``check_y`` / ``check_h`` / ``static_params`` in expand_add), so
bad input gets the entry's error and a plan packs exactly the entry's parameters;
tests/test_launch_plans.py compares a planned launch's bytes with the family entry's, bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch

from . import arch as _arch
from .identity_memo import IdentityMemo, tensor_key

ENV = "EPILORA_LAUNCH_PLANS"


@functools.lru_cache(maxsize=1)
def enabled() -> bool:
    """EPILORA_LAUNCH_PLANS (default 1), read once per process: 0 sends every call to the families'
    entries (a before / after of the host time in one process: ``enabled.cache_clear()``)."""
    return os.environ.get(ENV, "1") != "0"


_k1_plans = IdentityMemo()
_expand_plans = IdentityMemo()


class _Plan:
    """A launch plan and the facts the family's checks established when it was made."""
    __slots__ = ("launch", "max_loras", "rank", "widths", "n")

    def __init__(self, launch, max_loras: int, rank: int, widths: tuple = ()):
        self.launch, self.max_loras, self.rank = launch, max_loras, rank
        self.widths, self.n = widths, sum(widths)


def _objects(slices, meta_tensors, slot_ranks) -> tuple[tuple, tuple] | None:
    """(objects, plain key part) identifying a call's long-lived arguments for IdentityMemo; None
    when they are not what the ops pass (a list of 1..4 tensors)."""
    if not isinstance(slices, (list, tuple)) or not 1 <= len(slices) <= 4:
        return None
    objs, extra = list(meta_tensors), [slot_ranks is not None]
    if slot_ranks is not None:
        objs.append(slot_ranks)
    for t in slices:
        if not isinstance(t, torch.Tensor):
            return None
        o, e = tensor_key(t)
        objs += o
        extra.append(e)
    return tuple(objs), tuple(extra)


def clear() -> None:
    """Forget every plan (tests; a plan never outlives its objects anyway)."""
    _k1_plans.clear()
    _expand_plans.clear()


# ---------------------------------------------------------------------------------------------
# K1 (kernels_dsl.k1_shrink): x, codes, scales, h, then the long-lived parameters.

def _k1_meta(meta) -> tuple:
    return (meta.token_indices_sorted_by_lora_ids, meta.row_group, meta.active_lora_ids, meta.lora_token_start_loc)


@functools.lru_cache(maxsize=8192)  # pure in its arguments, asked on every planned launch
def _k1_grid(k: int, m: int, cfg, max_loras: int):
    from kernels_dsl.k1_shrink import grid

    return grid(k, m, cfg, max_loras=max_loras)


def _k1_key(x, lora_a_slices, meta, slot_ranks, h_bf16: bool):
    """(objects, key part, cfg, arch) of a K1 call, or None when no plan can serve it."""
    from kernels_dsl.k1_shrink import select_for_h

    key = _objects(lora_a_slices, _k1_meta(meta), slot_ranks)
    if key is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype is not torch.bfloat16:
        return None
    M, K = x.shape
    if M == 0 or meta.num_tokens != M:
        return None
    arch = _arch.arch_of(x)
    if arch is None:
        return None
    cfg = select_for_h(len(lora_a_slices), K, int(lora_a_slices[0].shape[-2]), M, h_bf16)
    objs, extra = key
    return objs, (*extra, K, cfg, arch, x.device), cfg, arch


def k1_quant_shrink(x, lora_a_slices, meta, codes=None, scales=None, h=None, slot_ranks=None, *,
                    h_dtype: torch.dtype = torch.float32):
    """``kernels_dsl.k1_shrink.k1_quant_shrink`` (codes and scales in token order, the kernel's own
    configuration), through a launch plan when one serves the call."""
    from kernels_dsl import k1_shrink

    h_bf16 = (h.dtype if h is not None else h_dtype) is torch.bfloat16
    key = _k1_key(x, lora_a_slices, meta, slot_ranks, h_bf16) if enabled() else None
    plan = _k1_plans.lookup(key[0], key[1]) if key is not None else None
    if plan is not None:
        return _k1_planned(plan, key[2], x, len(lora_a_slices), codes, scales, h, h_dtype)
    if codes is None and scales is None and h is None:
        out = k1_shrink.k1_quant_shrink(x, lora_a_slices, meta, slot_ranks=slot_ranks, h_dtype=h_dtype)
    else:
        out = k1_shrink.k1_quant_shrink(x, lora_a_slices, meta, codes, scales, h, slot_ranks=slot_ranks)
    if key is not None:  # checked by the family's entry just now: plan the next calls
        objs, extra, cfg, arch = key
        _k1_plans.get(objs, lambda: _make_k1_plan(lora_a_slices, meta, slot_ranks, cfg, arch), extra)
    return out


def _make_k1_plan(lora_a_slices, meta, slot_ranks, cfg, arch) -> _Plan:
    from kernels_dsl import k1_shrink

    from .kernels import get_kernel

    as_ = [k1_shrink.as_3d(a, "lora_a") for a in lora_a_slices]
    static = k1_shrink.static_params(as_, meta, slot_ranks, sorted_codes=False)
    kernel = get_kernel(k1_shrink, cfg, arch)
    L, R, _ = as_[0].shape
    return _Plan(kernel.plan({k1_shrink.DYNAMIC_PARAMS + i: v for i, v in enumerate(static)}), int(L), int(R))


def _k1_planned(plan: _Plan, cfg, x, num_slices: int, codes, scales, h, h_dtype):
    """The planned launch after the family's per-call checks (raising its errors), for what changes
    between calls: x and the outputs."""
    from kernels_dsl import k1_shrink

    M, K = k1_shrink.check_x(x)
    codes, scales, h = k1_shrink.outputs(x, num_slices, plan.rank, codes, scales, h, h_dtype)
    g, cl = _k1_grid(K, M, cfg, plan.max_loras)
    plan.launch(x, codes.view(torch.int16), scales.reshape(-1), h, grid=g, cluster=cl, smem=cfg.smem_bytes)
    return codes, scales, h


# ---------------------------------------------------------------------------------------------
# The expand-add (kernels_dsl.expand_add): y, h, then the long-lived parameters.

def _expand_meta(meta) -> tuple:
    return (meta.token_indices_sorted_by_lora_ids, meta.sorted_lora_ids, meta.row_group, meta.active_lora_ids,
            meta.lora_token_start_loc)


@functools.lru_cache(maxsize=8192)  # pure in its arguments, asked on every planned launch
def _expand_grid(widths: tuple, m: int, cfg, max_loras: int):
    from kernels_dsl.expand_add import grid

    return grid(widths, m, cfg, max_loras=max_loras)


def expand_add(y, h, lora_b_slices, meta, slot_ranks=None):
    """``kernels_dsl.expand_add.expand_add`` (the kernel's own configuration), through a launch plan
    when one serves the call. Returns y."""
    from kernels_dsl import expand_add as ea

    key = None
    if enabled() and isinstance(y, torch.Tensor) and y.dim() == 2 and y.dtype is torch.bfloat16 \
            and isinstance(h, torch.Tensor) and h.dim() == 3 and h.dtype in (torch.float32, torch.bfloat16):
        key = _expand_key(y, h, lora_b_slices, meta, slot_ranks)
    plan = _expand_plans.lookup(key[0], key[1]) if key is not None else None
    if plan is not None and y.shape[1] == plan.n:  # (another width: the entry raises its error)
        return _expand_planned(plan, key[2], y, h, len(lora_b_slices))
    ea.expand_add(y, h, lora_b_slices, meta, slot_ranks=slot_ranks)
    if key is not None:
        objs, extra, cfg, arch = key
        _expand_plans.get(objs, lambda: _make_expand_plan(lora_b_slices, meta, slot_ranks, cfg, arch), extra)
    return y


def _expand_key(y, h, lora_b_slices, meta, slot_ranks):
    return _expand_key_for(y.shape[0], y, lora_b_slices, meta, slot_ranks, h.dtype is torch.bfloat16)


def _expand_key_for(M: int, on, lora_b_slices, meta, slot_ranks, h_bf16: bool):
    """_expand_key for M rows on ``on``'s device (y's, or any tensor on it)."""
    from kernels_dsl.expand_add import select_for_h

    key = _objects(lora_b_slices, _expand_meta(meta), slot_ranks)
    if key is None or M == 0 or meta.num_tokens != M:
        return None
    arch = _arch.arch_of(on)
    if arch is None:
        return None
    cfg = select_for_h(len(lora_b_slices), M, int(lora_b_slices[0].shape[-1]), h_bf16)
    objs, extra = key
    return objs, (*extra, cfg, arch, on.device), cfg, arch


def _make_expand_plan(lora_b_slices, meta, slot_ranks, cfg, arch) -> _Plan:
    from kernels_dsl import expand_add as ea

    from .kernels import get_kernel

    bs = [ea.as_3d(b, "lora_b") for b in lora_b_slices]
    static = ea.static_params(bs, meta, slot_ranks)
    kernel = get_kernel(ea, cfg, arch)
    L, _, R = bs[0].shape
    widths = tuple(int(b.shape[1]) for b in bs)
    return _Plan(kernel.plan({ea.DYNAMIC_PARAMS + i: v for i, v in enumerate(static)}), int(L), int(R), widths)


def _expand_planned(plan: _Plan, cfg, y, h, num_slices: int):
    """The planned launch after the family's per-call checks (raising its errors) of y and h."""
    from kernels_dsl import expand_add as ea

    M, _ = ea.check_y(y)
    ea.check_h(h, num_slices, M, plan.rank, y.device)
    plan.launch(y, h, grid=_expand_grid(plan.widths, M, cfg, plan.max_loras), smem=cfg.smem_bytes)
    return y


# ---------------------------------------------------------------------------------------------
# Both plans of a hybrid call at once (epilora_cute/eager_memo.py keeps them per settled call).

def hybrid_plans(x, lora_a_slices, lora_b_slices, meta, slot_ranks, h_dtype: torch.dtype, widths) -> dict | None:
    """The K1 and expand-add plans a hybrid call on x ([M, K]) launches through, with their grids
    and shared memory, as ``_hybrid_path`` finds them now; None when either plan does not exist
    (yet) or would not serve the call."""
    if not enabled():
        return None
    h_bf16 = h_dtype is torch.bfloat16
    k1_key = _k1_key(x, lora_a_slices, meta, slot_ranks, h_bf16)
    k1 = _k1_plans.lookup(k1_key[0], k1_key[1]) if k1_key is not None else None
    ea_key = _expand_key_for(x.shape[0], x, lora_b_slices, meta, slot_ranks, h_bf16)
    ea = _expand_plans.lookup(ea_key[0], ea_key[1]) if ea_key is not None else None
    if k1 is None or ea is None or ea.n != sum(widths) or ea.widths != tuple(widths):
        return None
    M, K = x.shape
    g, cl = _k1_grid(K, M, k1_key[2], k1.max_loras)
    return {"k1": k1.launch, "k1_grid": g, "k1_cluster": cl, "k1_smem": k1_key[2].smem_bytes,
            "expand": ea.launch, "expand_grid": _expand_grid(ea.widths, M, ea_key[2], ea.max_loras),
            "expand_smem": ea_key[2].smem_bytes}
