"""The cache's entry layout as Triton compile-time constants (``dsv4.formats.layouts``, SPEC §7.2, §11), for use
inside ``@triton.jit`` / Gluon kernels, which read only ``constexpr`` globals. Host code uses
``dsv4.kernels.device`` (no Triton import needed there)."""

from __future__ import annotations

import triton.language as tl

from ..formats import layouts

__all__ = ["KV_DATA_BYTES", "KV_DIM", "KV_NOPE_DIM", "KV_ROPE_DIM", "KV_SCALE_BYTES"]

#: a KV entry's data bytes in its page: 448 E4M3 codes + 64 BF16 rope values (its scale bytes follow the page's rows)
KV_DATA_BYTES: tl.constexpr = tl.constexpr(layouts.KV_DATA_BYTES)
#: a KV entry's 7 UE8M0 scale bytes + 1 zero pad byte
KV_SCALE_BYTES: tl.constexpr = tl.constexpr(layouts.KV_SCALE_BYTES)
KV_DIM: tl.constexpr = tl.constexpr(layouts.KV_DIM)
KV_NOPE_DIM: tl.constexpr = tl.constexpr(layouts.KV_NOPE_DIM)
KV_ROPE_DIM: tl.constexpr = tl.constexpr(layouts.KV_ROPE_DIM)
