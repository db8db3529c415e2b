"""The C allocator's handling of large blocks during training.

A long-context training step allocates and frees many tensors of a few hundred KB to tens of MB
whose sizes change from chunk to chunk (heads/ttt_attention.py, heads/losses.py). glibc serves
blocks under its mmap threshold from its heap, and raises that threshold up to 32 MB as large
blocks are freed, so most of them end up there: the heap fragments and freed memory is not given
back to the system. A fixed 128 KiB threshold gives the memory back, and costs the page faults
of fresh mappings. Measured on one EAGLE-3 step of SmolLM2's head (docs/scaling.md "Long
conversations"), step memory and time with glibc's defaults / with the fixed threshold:
2K tokens 647 / 269 MB, 13 / 19 s; 8K 2,702 / 1,605 MB, 71 / 98 s; 16K 6,536 / 3,568 MB,
378 / 353-372 s. So training fixes it for rows of LONG_ROW_TOKENS or more only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10
LONG_ROW_TOKENS = 16384  # rows this long fragment the heap more than the fixed threshold costs


def map_large_blocks_for(row_tokens: int) -> bool:
    """`map_large_blocks` where rows of `row_tokens` tokens call for it (LONG_ROW_TOKENS)."""
    return row_tokens >= LONG_ROW_TOKENS and map_large_blocks()


def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve blocks of `threshold` bytes or more from their own mappings, returned to the system
    when freed (a fixed threshold also stops glibc from raising it). Linux with glibc only; True
    when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
