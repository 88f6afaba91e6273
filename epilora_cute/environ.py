"""Environment switches read on the per-call host path, cheaply.

``os.environ.get`` costs ~1 µs per unset name (os.environ raises and catches a KeyError), which
adds up in an eager projection call that reads several switches. On POSIX os.environ keeps its
contents in a dict of encoded names and values, which its setters (and pytest's monkeypatch)
write: ``values`` reads that dict directly. Values come back encoded (bytes on POSIX): compare
them through ``text`` or only for truthiness / identity as cache keys.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def keys(names: tuple[str, ...]) -> tuple:
    """The lookup keys of ``names`` for ``values`` (encoded once, at import of the caller)."""
    return tuple(os.environ.encodekey(n) for n in names) if _DATA is not None else tuple(names)


def values(ks: tuple) -> tuple:
    """The current values of the variables ``ks`` (from ``keys``), None where unset."""
    if _DATA is not None:
        return tuple(map(_DATA.get, ks))
    return tuple(map(os.environ.get, ks))


def text(value) -> str | None:
    """A value from ``values`` as os.environ would return it."""
    return os.environ.decodevalue(value) if _DATA is not None and value is not None else value
