"""IdentityMemo (CPU): facts about long-lived buffers computed once per set of buffer objects."""

import gc
import weakref

import pytest
import torch

from epilora_cute.identity_memo import IdentityMemo


def test_hit_only_for_the_very_same_objects():
    memo, made = IdentityMemo(), []
    a, b = torch.zeros(4), torch.zeros(4)

    def make(tag):
        made.append(tag)
        return tag

    assert memo.get((a, b), lambda: make(1)) == 1
    assert memo.get((a, b), lambda: make(2)) == 1  # hit
    assert memo.get((b, a), lambda: make(3)) == 3  # order matters
    assert memo.get((a, b.view(4)), lambda: make(4)) == 4  # an equal view is another object
    assert made == [1, 3, 4]


def test_a_recycled_id_is_not_a_hit():
    """A dead object's id may be reused by a new one; the weak reference tells them apart."""
    memo = IdentityMemo()
    t = torch.zeros(4)
    memo.get((t,), lambda: "old")
    key = (id(t), ())
    refs, value = memo._d[key]
    del t
    gc.collect()
    assert refs[0]() is None
    u = torch.zeros(8)
    memo._d[(id(u), ())] = (refs, value)  # as if u had been given the dead tensor's id
    assert memo.get((u,), lambda: "new") == "new"


def test_the_memo_keeps_no_buffer_alive():
    memo = IdentityMemo()
    t = torch.zeros(1024)
    r = weakref.ref(t)
    memo.get((t,), lambda: (int(t.numel()), t.dtype))
    del t
    gc.collect()
    assert r() is None


def test_a_failing_make_stores_nothing_and_full_memo_starts_over():
    memo = IdentityMemo(maxsize=2)
    t = torch.zeros(1)
    with pytest.raises(ValueError):
        memo.get((t,), lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert len(memo) == 0
    ts = [torch.zeros(1) for _ in range(3)]
    for i, x in enumerate(ts):
        memo.get((x,), lambda: i)
    assert len(memo) == 1  # emptied when full, then the third stored


def test_fresh_views_of_one_base_share_an_entry_and_other_geometries_do_not():
    """What an engine passes: weight.t() made anew on every call is one tensor; a view of another
    shape, offset or dtype of the same base is another."""
    from epilora_cute.identity_memo import tensor_key

    memo, made = IdentityMemo(), []
    w = torch.zeros(8, 16)

    def facts(t):
        objs, extra = tensor_key(t)
        return memo.get(objs, lambda: made.append(tuple(t.shape)) or tuple(t.shape), extra)

    assert facts(w.t()) == (16, 8) and facts(w.t()) == (16, 8) and len(made) == 1
    assert facts(w) == (8, 16) and len(made) == 2  # the base itself
    assert facts(w[1:].t()) == (16, 7) and facts(w[:, :8].t()) == (8, 8) and len(made) == 4
    assert facts(w.view(torch.int32).t()) == (16, 8) and len(made) == 5  # another dtype


def test_layer_facts_follow_a_replaced_weight():
    """ops._validate_linear with the weight passed as a fresh view each call: memoized per base,
    and a weight of another shape given later is validated anew (and refused)."""
    from epilora_cute import ops
    from tests.test_ops import _linear_case

    x, wq, ws, a, b, meta, _ = _linear_case()
    base = wq.t().contiguous()  # stored [K, N] as vLLM keeps its FP8 weights; the op gets .t()
    for _ in range(3):
        assert ops._validate_linear(x, base.t(), ws.reshape(1), a, b, meta, None)[2] == (32, 16, 16)
    with pytest.raises(ValueError, match="add up"):
        ops._validate_linear(x, torch.cat([base, base], 1).t(), ws.reshape(1), a, b, meta, None)
