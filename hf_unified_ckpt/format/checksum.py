"""The CRC-32 every file and byte range is checked with (the manifest's `crc32`: zlib's polynomial and values).

Computed by ISA-L (`isal.isal_zlib.crc32`, carry-less multiplication: about 25 GB/s on one core here, 6.5x zlib's
3.9 GB/s) when python-isal is installed, as it is with this package on CPython, else by zlib: the same values
either way (`tests/unit/test_format.py` checks them against zlib)."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # no ISA-L wheel for this platform: zlib's, slower, same values
    from zlib import crc32

__all__ = ["crc32"]
