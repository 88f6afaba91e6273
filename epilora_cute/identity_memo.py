"""Facts about long-lived objects (a layer's weight and adapter buffers), computed once per set of
objects instead of once per call.

An eager projection call used to re-validate every buffer it was given and recompute what the
launch needs from them (~30 tensor attribute reads per call), although in an engine the weight
and adapter buffers of a layer are the same tensors on every call. ``IdentityMemo`` keys a value
by the identity of the objects it was computed from; a hit requires every one of them to be the
very object seen then (weak references, so the memo never keeps a buffer alive and a recycled
``id`` cannot alias a dead object).

What may be stored: plain values (ints, strings, tuples of them, bytes). Never a tensor or a view
of one: a view keeps its base alive (torch preserves the base's Python object), which would pin
every buffer ever seen.

A view made anew on every call (``weight.t()``, ``scale.reshape(1)``: what an engine's compiled
code passes) is keyed by its base and its geometry instead (``tensor_key``).

Assumed: a tensor's address, shape, strides and dtype do not change in place (``resize_``,
``set_``, ``as_strided_``) — vLLM updates its adapter buffers with in-place copies only.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


class IdentityMemo:
    def __init__(self, maxsize: int = 4096):
        self._d: dict[tuple, tuple] = {}
        self._maxsize = maxsize

    def get(self, objs: Sequence, make: Callable[[], T], extra: tuple = ()) -> T:
        """The value for these objects (and the plain key part ``extra``), made once."""
        key = (*map(id, objs), extra)
        hit = self._d.get(key)
        if hit is not None:
            refs, value = hit
            for r, o in zip(refs, objs):
                if r() is not o:
                    break
            else:
                return value
        value = make()  # may raise: nothing is stored then
        if len(self._d) >= self._maxsize:
            self._d.clear()
        self._d[key] = (tuple(weakref.ref(o) for o in objs), value)
        return value

    def lookup(self, objs: Sequence, extra: tuple = ()):
        """The value stored for these objects and ``extra``, or None (nothing made or stored)."""
        hit = self._d.get((*map(id, objs), extra))
        if hit is None:
            return None
        refs, value = hit
        for r, o in zip(refs, objs):
            if r() is not o:
                return None
        return value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


def tensor_key(t) -> tuple:
    """(objects, plain key part) identifying tensor t for IdentityMemo: t itself, or for a view its
    base and the view's geometry (a fresh view of the same base and geometry is the same tensor)."""
    base = t._base
    if base is None:
        return (t,), ()
    return (base,), (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
