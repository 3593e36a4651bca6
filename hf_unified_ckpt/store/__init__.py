"""The storage seam: the only package that touches checkpoint bytes at rest (see `base`). `LocalStore` serves
local paths, `FsspecStore` `memory://` URLs, `S3Store` `s3://` (S3 and S3-compatible servers); `gs://` and `az://`
are refused by name. A new backend is one module here, registered by URL scheme with `register_store`; what it has
beyond the `Store` protocol is a capability protocol it implements (`PositionalWrites`, `MultipartUploads`,
`LocalPaths`, `WritableMappings`), asked for with `positional_writes_of`, `multipart_of`, `local_paths_of`,
`writable_mappings_of`."""

from .base import (DELETING_SUFFIX, STAGING_SUFFIX, SUPERSEDED_SUFFIX, Capabilities, LocalPaths, MultipartUploads,
                   PositionalWrites, Store, WritableMappings, as_ref, canonical, is_file, is_folder, join, listing,
                   local_paths_of, multipart_of, name_of, open_mapped_tensors, parent_of, positional_writes_of,
                   put_bytes, read_bytes, register_store, remove, scheme_of, sibling, store_for, writable_mappings_of)
from .fsspec_store import FsspecStore
from .local import LocalStore
from .local_io import WritableMaps
from .s3 import S3Store, refuse_scheme

register_store("", LocalStore)
register_store("file", LocalStore)
register_store("memory", FsspecStore)
register_store("s3", S3Store)
for _scheme in ("gs", "gcs", "az", "abfs", "abfss"):
    register_store(_scheme, refuse_scheme)

__all__ = ["Capabilities", "DELETING_SUFFIX", "FsspecStore", "LocalPaths", "LocalStore", "MultipartUploads",
           "PositionalWrites", "S3Store", "STAGING_SUFFIX", "SUPERSEDED_SUFFIX", "Store", "WritableMappings", "WritableMaps", "as_ref",
           "canonical", "is_file", "is_folder", "join", "listing", "local_paths_of", "multipart_of", "name_of",
           "open_mapped_tensors", "parent_of", "positional_writes_of", "put_bytes", "read_bytes", "register_store", "remove", "scheme_of",
           "sibling", "store_for", "writable_mappings_of"]
