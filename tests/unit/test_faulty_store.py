"""The fault-injection store of the tests (`faulty_store.py`) is the store it wraps, with hooks: the same capability
protocols and flags (the algorithms choose from them, so a test must not change what a save does), and its hooks
see the calls the library makes through `store_for`."""

import errno

import pytest

from support.faulty_store import fail_with, faulty_store, injected, on, recording
from hf_unified_ckpt.store import (LocalPaths, MultipartUploads, PositionalWrites, Store, WritableMappings, join,
                                   put_bytes, read_bytes, store_for)


@pytest.mark.parametrize("ref", ["/x", "file:///x", "memory://x", "s3://bucket/x"])
def test_a_faulty_store_has_exactly_the_capabilities_of_the_store_it_wraps(ref):
    real = store_for(ref)
    faulty = faulty_store(type(real))(real.scheme)
    assert isinstance(faulty, type(real)) and faulty.capabilities == real.capabilities
    for protocol in (Store, PositionalWrites, MultipartUploads, LocalPaths, WritableMappings):
        assert isinstance(faulty, protocol) == isinstance(real, protocol), (ref, protocol)


def test_hooks_see_the_library_calls_and_the_real_store_comes_back(tmp_path):
    ref = join(str(tmp_path), "a.json")
    calls = []
    with injected(recording(calls, ("put", "read")), on("put", lambda c: c.ref.endswith("b.json"),
                                                        fail_with(lambda r: OSError(errno.EROFS, "injected", r)))):
        put_bytes(ref, b"{}")
        assert read_bytes(ref) == b"{}"
        with pytest.raises(OSError, match="injected"):
            put_bytes(join(str(tmp_path), "b.json"), b"{}")
    assert [(c.method, c.ref) for c in calls] == [("put", ref), ("read", ref)]
    assert type(store_for(ref)).__name__ == "LocalStore"
    put_bytes(join(str(tmp_path), "b.json"), b"{}")
