"""`FaultyStore`: a real store with fault hooks, installed for a URL scheme through the store seam
(`store.register_store`), instead of rebinding module globals or `LocalStore` methods.

`faulty_store(cls)` is a subclass of store class `cls` whose store methods (those `cls` has: `HOOKED`) first pass
through the installed hooks; it adds no method, so it implements exactly the capability protocols of `cls`
(`PositionalWrites`, `LocalPaths`, ... and its `Capabilities` are the same). `injected(*hooks)` installs one for
the scheme of `ref` (local paths by default) and restores the real store after: every `store_for` of that scheme
in this process answers with it meanwhile.

A hook is `hook(call)`: it sees the method's name and arguments (`call.method`, `call.ref`, `call.args`) and
returns the method's result, normally `call.proceed()` (the real method, or the next hook), possibly with other
arguments (`call.proceed(ref, ranges, ...)`), or raises, or ends the process (`die`). Hooks act in this process:
processes forked from it after `injected` (fork_launch ranks) inherit them; a process started anew (`python -m`:
the writer process, a worker launched by path) installs its own from what its spec or argv names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_unified_ckpt.store import register_store, scheme_of, store_for

#: The store methods a hook can see (a store class gets only those it has).
HOOKED = ("list", "size", "is_folder", "read", "read_chunks", "crc32", "put", "write_whole", "write_at", "sync",
          "move", "make_folder", "remove", "stage", "publish", "retire", "map_writable", "start_upload",
          "write_part", "finish_upload")
#: The exit status of a process that `die`s (as under kill -9: 128 + 9).
KILLED = 137


@dataclass
class Call:
    """One call of store method `method` with `args`/`kwargs` (`args[0]`: the reference it acts on; `publish`'s
    is the staging folder, `args[1]` the final one). `proceed` runs the rest: the next hook, then the real method;
    `result` is what it returned (set by `recording`)."""

    method: str
    args: tuple
    kwargs: dict
    _next: Callable[..., Any]
    result: Any = None

    @property
    def ref(self) -> str:
        return str(self.args[0])

    def arg(self, position: int, name: str, default=None):
        """Argument `name`, given at `position` or by name, else `default` (the method's own)."""
        return self.args[position] if len(self.args) > position else self.kwargs.get(name, default)

    def proceed(self, *args, **kwargs):
        return self._next(*(args or self.args), **(kwargs or self.kwargs))


Hook = Callable[[Call], Any]
_CLASSES: dict[type, type] = {}


def faulty_store(cls: type) -> type:
    """The subclass of store class `cls` whose methods pass through the hooks of the instance (`hooks`)."""
    if cls not in _CLASSES:
        methods = {name: _hooked(name, getattr(cls, name)) for name in HOOKED if callable(getattr(cls, name, None))}

        def __init__(self, scheme: str, hooks=()):
            cls.__init__(self, scheme)
            self.hooks = list(hooks)

        _CLASSES[cls] = type(f"Faulty{cls.__name__}", (cls,), {"__init__": __init__, **methods,
                                                                "__doc__": f"{cls.__name__} with fault hooks."})
    return _CLASSES[cls]


def _hooked(name: str, real: Callable) -> Callable:
    def method(self, *args, **kwargs):
        def run(i: int) -> Callable:
            if i == len(self.hooks):
                return lambda *a, **k: real(self, *a, **k)
            return lambda *a, **k: self.hooks[i](Call(name, a, k, run(i + 1)))
        return run(0)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


@contextlib.contextmanager
def injected(*hooks: Hook, ref: str = ""):
    """A `FaultyStore` with `hooks` answers every reference of `ref`'s URL scheme in this process while the block
    runs (a fresh instance of the scheme's store class); then the real one that answered before, the same instance.
    The faulty one is closed on the way out where its class holds resources (`close`: S3's event loop thread).
    Yields the faulty store."""
    scheme = scheme_of(str(ref))
    real = store_for(ref or "/")
    store = faulty_store(type(real))(scheme, hooks)
    register_store(scheme, lambda _: store)
    try:
        yield store
    finally:
        register_store(scheme, lambda _: real)
        if callable(getattr(store, "close", None)):
            store.close()


def die() -> None:
    """End this process at once, as under kill -9: no clean-up, no exception, no atexit."""
    sys.stdout.flush()
    os._exit(KILLED)


def no_space(ref: str) -> OSError:
    """What a full disk (or a full tmpfs) raises."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ref))


def on(methods: str | tuple[str, ...], when: Callable[[Call], bool], then: Callable[[Call], Any]) -> Hook:
    """A hook: for a call of one of `methods` where `when(call)`, `then(call)` (raise, die, or return what the call
    returns); every other call proceeds as it is."""
    methods = (methods,) if isinstance(methods, str) else methods

    def hook(call: Call):
        if call.method in methods and when(call):
            return then(call)
        return call.proceed()
    return hook


def fail_with(error: Callable[[str], BaseException]) -> Callable[[Call], Any]:
    """A `then` for `on`: raise `error(ref)` instead of the call."""
    def then(call: Call):
        raise error(call.ref)
    return then


def nth(n: int, when: Callable[[Call], bool] = lambda call: True) -> Callable[[Call], bool]:
    """A `when` for `on`: the `n`-th call (from 1) that `when` matches, only it."""
    seen = [0]

    def match(call: Call) -> bool:
        if when(call):
            seen[0] += 1
            return seen[0] == n
        return False
    return match


def recording(calls: list, methods: str | tuple[str, ...] = "read") -> Hook:
    """A hook that appends each call of `methods` to `calls` (a `Call`: its method, arguments and `result`), once it
    returned."""
    methods = (methods,) if isinstance(methods, str) else methods

    def hook(call: Call):
        call.result = call.proceed()
        if call.method in methods:
            calls.append(call)
        return call.result
    return hook
