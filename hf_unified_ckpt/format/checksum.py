"""The CRC-32 every file and byte range is checked with (the manifest's `crc32`: zlib's polynomial and values).

Computed by ISA-L (`isal.isal_zlib.crc32`, carry-less multiplication: about 25 GB/s on one core here, 6.5x zlib's
3.9 GB/s) when python-isal is installed, as it is with this package on CPython, else by zlib: the same values
either way (`tests/unit/test_format.py` checks them against zlib). `crc32_combine` joins the CRC-32s of adjacent
ranges (ISA-L's, else `crc32_combine_py`): a range's checksum from its parts, computed apart (by the writer threads
from the bytes they copied, by each rank, by each part of an upload)."""

from __future__ import annotations

import functools

try:
    from isal.isal_zlib import crc32
except ImportError:  # no ISA-L wheel for this platform: zlib's, slower, same values
    from zlib import crc32


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B): ISA-L's compiled `crc32_combine` (python-isal, installed with
    this package on CPython: about 1 us; Python's zlib lacks zlib's), else `crc32_combine_py`."""
    return _combine(crc1, crc2, len2)


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """`crc32_combine` in Python: crc(A) shifted over len(B) zero bytes, XOR crc(B). The shift is a product of
    GF(2) 32x32 matrices, one per set bit of len(B), each the zero-byte operator squared k times (computed once per
    process)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.cache
def _zeros_operator(k: int) -> tuple[int, ...]:
    """The operator that appends 2**k zero bytes to a CRC-32 register."""
    if k == 0:
        bit = (0xEDB88320,) + tuple(1 << n for n in range(31))  # appends one zero bit
        for _ in range(3):
            bit = tuple(_gf2_times(bit, bit[n]) for n in range(32))
        return bit
    half = _zeros_operator(k - 1)
    return tuple(_gf2_times(half, half[n]) for n in range(32))


try:
    from isal.isal_zlib import crc32_combine as _combine
except ImportError:  # pragma: no cover - PyPy, or python-isal missing
    _combine = crc32_combine_py


__all__ = ["crc32", "crc32_combine", "crc32_combine_py"]
