"""The storage seam: the only package that touches checkpoint bytes at rest (see `base`). `LocalStore` serves
local paths; `FsspecStore` serves `memory://` URLs. A new backend is one module here, registered by URL scheme
with `register_store`."""

from .base import (Capabilities, Store, as_ref, canonical, is_file, is_folder, join, listing, name_of, parent_of, put_bytes,
                   read_bytes, register_store, remove, scheme_of, sibling, store_for)
from .fsspec_store import FsspecStore
from .local import LocalStore

register_store("", LocalStore)
register_store("file", LocalStore)
register_store("memory", FsspecStore)

__all__ = ["Capabilities", "FsspecStore", "LocalStore", "Store", "as_ref", "canonical", "is_file", "is_folder", "join", "listing",
           "name_of", "parent_of", "put_bytes", "read_bytes", "register_store", "remove", "scheme_of", "sibling",
           "store_for"]
