"""Entry storage codecs: how one cached vector (a 512-dim KV entry or a 128-dim indexer key) is laid out in a
page of raw bytes, and how whole batches of entries are scattered into / gathered from ``uint8`` pages.

A *page* is one row of a ``uint8`` tensor ``pages[num_pages, page_bytes]``: a pool block of the compressed cache
(``entries_per_page = block_size // m`` entries) or the SWA ring of one state slot (``entries_per_page = window``).
An entry is addressed by ``(page id, slot)``.

Every format splits an entry's bytes into one or more *segments* (e.g. FP8 codes + BF16 rope, then scale bytes).
Inside a page, segment ``k`` of all entries is stored contiguously, one segment after the other::

    page = [seg0 of entry 0 | seg0 of entry 1 | … | seg0 of entry n−1 | seg1 of entry 0 | … | padding]

so segment ``k`` of slot ``j`` starts at byte ``n·Σ_{k'<k} w_k' + j·w_k``. A single-segment format is plain
contiguous ``[n, entry_bytes]``. The *canonical* entry bytes (``read_bytes`` / ``write_bytes`` / ``encode``) are the
segments concatenated in order.

Formats (``dsv4.numerics.KV_FORMATS`` / ``INDEX_FORMATS``):

============  =====  ======================================================================================
name          bytes  layout
============  =====  ======================================================================================
fp8_ds_mla     584   FlashMLA / vLLM: [448 E4M3 codes | 64 BF16 rope] (576) then [7 UE8M0 exps | pad] (8);
                     page stride padded to a multiple of 576 (SPEC §7.2, §11)
fp8_per_token  580   contiguous [448 E4M3 codes | 64 BF16 rope | fp32 scale] (the prototype's format)
fp32 (KV)     2048   contiguous raw fp32
mxfp4           68   [64 B packed E2M1] then [4 UE8M0 exps] (DeepGEMM style, as ``formats.mxfp4_page_views``)
nvfp4           72   [64 B packed E2M1] then [8 E4M3 scale codes] (block 16)
fp8 (index)    132   [128 E4M3 codes] then [fp32 scale] (vLLM Hopper default)
fp32 (index)   512   contiguous raw fp32
============  =====  ======================================================================================

Indexer keys are stored as given: the Hadamard rotation (SPEC §2.3) is applied by the caller before ``write``.

No Python loops over entries: ``write`` is one encode plus one ``index_put_`` per segment; ``read`` is one
gather per segment plus one decode. Writing the same ``(page, slot)`` twice in one call is undefined (last
writer is unspecified), as for any scatter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from .. import formats
from ..numerics import INDEX_FORMATS, KV_FORMATS

__all__ = [
    "EntryStorage",
    "Fp8DsMlaStorage",
    "Fp8PerTokenStorage",
    "Fp32Storage",
    "Mxfp4KeyStorage",
    "Nvfp4KeyStorage",
    "Fp8KeyStorage",
    "kv_storage",
    "index_storage",
]


def _as_bytes(t: Tensor) -> Tensor:
    """``[E, k]`` tensor of any dtype → ``[E, k·itemsize]`` uint8 (a copy-free reinterpretation when contiguous)."""
    return t.contiguous().view(torch.uint8)


class EntryStorage(ABC):
    """Codec of one entry format over ``uint8`` pages.

    Attributes:
        name: the format name (``kv_format`` / ``index_format`` value).
        dim: length of the float vector one entry holds (512 for KV, 128 for indexer keys).
        segments: bytes per entry of each segment, in page order; ``entry_bytes = sum(segments)``.
        page_align: page stride is rounded up to a multiple of this many bytes (576 for ``fp8_ds_mla``, else 1).
    """

    name: str
    dim: int
    segments: tuple[int, ...]
    page_align: int = 1

    # ---------------------------------------------------------------- geometry (pure arithmetic)
    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry (all segments, no page padding)."""
        return sum(self.segments)

    def page_bytes(self, entries_per_page: int) -> int:
        """Bytes of one page of ``entries_per_page`` entries, padding included."""
        if entries_per_page < 0:
            raise ValueError(f"entries_per_page must be >= 0, got {entries_per_page}")
        raw = entries_per_page * self.entry_bytes
        return -(-raw // self.page_align) * self.page_align

    def entries_per_page(self, page_bytes: int) -> int:
        """Inverse of ``page_bytes`` (page sizes are strictly increasing in the entry count)."""
        n = page_bytes // self.entry_bytes
        if self.page_bytes(n) != page_bytes:
            raise ValueError(
                f"{page_bytes} bytes is not a page size of format {self.name!r} "
                f"(entry {self.entry_bytes} B, pages are aligned to {self.page_align} B; "
                f"{n} entries would take {self.page_bytes(n)} B)"
            )
        return n

    def segment_views(self, pages: Tensor, entries_per_page: int | None = None) -> list[Tensor]:
        """Views ``[..., n, w_k]`` of every segment of ``pages[..., page_bytes]`` (no copy; writes go through)."""
        self._check_pages(pages)
        n = self.entries_per_page(pages.shape[-1]) if entries_per_page is None else entries_per_page
        if self.page_bytes(n) != pages.shape[-1]:
            raise ValueError(
                f"pages have {pages.shape[-1]} bytes per page; format {self.name!r} with {n} entries needs "
                f"{self.page_bytes(n)}"
            )
        views, offset = [], 0
        for width in self.segments:
            views.append(pages[..., offset : offset + n * width].unflatten(-1, (n, width)))
            offset += n * width
        return views

    # ---------------------------------------------------------------- codec
    @abstractmethod
    def encode(self, values: Tensor) -> Tensor:
        """``values`` float ``[E, dim]`` → canonical entry bytes ``uint8 [E, entry_bytes]``."""

    @abstractmethod
    def decode(self, entries: Tensor) -> Tensor:
        """Canonical entry bytes ``uint8 [E, entry_bytes]`` → ``float32 [E, dim]``."""

    # ---------------------------------------------------------------- paged access
    def write_bytes(self, pages: Tensor, block_ids: Tensor, slots: Tensor, entries: Tensor) -> None:
        """Scatter canonical entry bytes ``uint8 [E, entry_bytes]`` to ``(block_ids[e], slots[e])``, in place.

        Args:
            pages: ``uint8 [num_pages, page_bytes]`` (modified in place).
            block_ids: ``int64 [E]`` page of each entry.
            slots: ``int64 [E]`` slot of each entry inside its page (``0 ≤ slot < entries_per_page``).
            entries: ``uint8 [E, entry_bytes]``.
        """
        self._check_ids(block_ids, slots)
        if entries.dtype != torch.uint8 or entries.dim() != 2 or entries.shape[1] != self.entry_bytes:
            raise ValueError(
                f"{self.name}: entries must be uint8 [E, {self.entry_bytes}], got {entries.dtype} {list(entries.shape)}"
            )
        if entries.shape[0] != block_ids.shape[0]:
            raise ValueError(f"{self.name}: {entries.shape[0]} entries but {block_ids.shape[0]} block ids")
        if pages.device != entries.device:
            raise ValueError(f"{self.name}: pages on {pages.device} but entries on {entries.device}")
        offset = 0
        for view, width in zip(self.segment_views(pages), self.segments):
            view[block_ids, slots] = entries[:, offset : offset + width]
            offset += width

    def read_bytes(self, pages: Tensor, block_ids: Tensor, slots: Tensor) -> Tensor:
        """Gather canonical entry bytes: returns ``uint8 [E, entry_bytes]`` for ``(block_ids[e], slots[e])``."""
        self._check_ids(block_ids, slots)
        return torch.cat([view[block_ids, slots] for view in self.segment_views(pages)], dim=-1)

    def write(self, pages: Tensor, block_ids: Tensor, slots: Tensor, values: Tensor) -> None:
        """Encode ``values`` float ``[E, dim]`` and scatter them to ``(block_ids[e], slots[e])`` of ``pages``."""
        if values.dim() != 2 or values.shape[1] != self.dim:
            raise ValueError(f"{self.name}: values must be [E, {self.dim}], got {list(values.shape)}")
        self.write_bytes(pages, block_ids, slots, self.encode(values))

    def read(self, pages: Tensor, block_ids: Tensor, slots: Tensor) -> Tensor:
        """Gather and decode: returns ``float32 [E, dim]``."""
        return self.decode(self.read_bytes(pages, block_ids, slots))

    # ---------------------------------------------------------------- checks (metadata only, no device sync)
    def _check_pages(self, pages: Tensor) -> None:
        if pages.dtype != torch.uint8 or pages.dim() < 1:
            raise ValueError(f"{self.name}: pages must be a uint8 tensor [..., page_bytes], got {pages.dtype}")

    def _check_ids(self, block_ids: Tensor, slots: Tensor) -> None:
        if block_ids.dim() != 1 or slots.shape != block_ids.shape:
            raise ValueError(
                f"{self.name}: block_ids and slots must be 1-D of equal length, got {list(block_ids.shape)} "
                f"and {list(slots.shape)}"
            )
        for t, what in ((block_ids, "block_ids"), (slots, "slots")):
            if t.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{self.name}: {what} must be int64 or int32, got {t.dtype}")

    def _check_entries(self, entries: Tensor) -> None:
        if entries.dtype != torch.uint8 or entries.shape[-1] != self.entry_bytes:
            raise ValueError(
                f"{self.name}: entries must be uint8 [..., {self.entry_bytes}], got {entries.dtype} {list(entries.shape)}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, dim={self.dim}, entry_bytes={self.entry_bytes})"


# ====================================================================================== KV formats (dim 512)
class Fp8DsMlaStorage(EntryStorage):
    """FlashMLA / vLLM ``fp8_ds_mla`` 584-B entries (official numerics): data segment 576 B (448 E4M3 codes + 64
    BF16 rope), scale segment 8 B (7 UE8M0 exponents + pad); page stride padded to a multiple of 576 B."""

    name = "fp8_ds_mla"
    dim = 512
    segments = (576, 8)
    page_align = 576

    def encode(self, values: Tensor) -> Tensor:
        data, scales = formats.encode_kv_entries(values, check=False)
        return torch.cat([data, scales], dim=-1)

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        return formats.decode_kv_entries(entries[..., :576], entries[..., 576:])


class Fp8PerTokenStorage(EntryStorage):
    """The prototype's per-token FP8 entry, contiguous: ``nope_dim`` E4M3 codes (one fp32 scale amax/448 for the
    whole entry), ``rope_dim`` BF16 rope values, then the fp32 scale (4 B). 580 B for 512 = 448 + 64."""

    name = "fp8_per_token"

    def __init__(self, dim: int = 512, rope_dim: int = 64) -> None:
        if not 0 <= rope_dim < dim:
            raise ValueError(f"fp8_per_token: rope_dim {rope_dim} must be in [0, dim={dim})")
        self.dim = dim
        self.rope_dim = rope_dim
        self.nope_dim = dim - rope_dim
        self.segments = (self.nope_dim + 2 * rope_dim + 4,)

    def encode(self, values: Tensor) -> Tensor:
        codes, scale = formats.quantize_fp8_per_token(values[..., : self.nope_dim], check=False)
        rope = values[..., self.nope_dim :].to(torch.bfloat16)
        scale = scale.float().reshape(*values.shape[:-1], 1)
        return torch.cat([codes, _as_bytes(rope), _as_bytes(scale)], dim=-1)

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        n, r = self.nope_dim, self.rope_dim
        codes = entries[..., :n]
        rope = entries[..., n : n + 2 * r].contiguous().view(torch.bfloat16).float()
        scale = entries[..., n + 2 * r :].contiguous().view(torch.float32)[..., 0]
        return torch.cat([formats.dequantize_fp8_per_token(codes, scale), rope], dim=-1)


class Fp32Storage(EntryStorage):
    """Unquantized: ``dim`` raw little-endian fp32 values, contiguous (KV: 2048 B; indexer keys: 512 B)."""

    name = "fp32"

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.segments = (4 * dim,)

    def encode(self, values: Tensor) -> Tensor:
        return _as_bytes(values.float())

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        return entries.contiguous().view(torch.float32)


# ====================================================================================== indexer key formats (dim 128)
class Mxfp4KeyStorage(EntryStorage):
    """Official indexer key, 68 B: 64 B packed E2M1 (low nibble = even element) then 4 UE8M0 exponents (block 32)."""

    name = "mxfp4"
    dim = 128
    segments = (64, 4)

    def encode(self, values: Tensor) -> Tensor:
        return formats.encode_mxfp4_keys(values, check=False)

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        return formats.decode_mxfp4_keys(entries)


class Nvfp4KeyStorage(EntryStorage):
    """The prototype's NVFP4 indexer key, 72 B: 64 B packed E2M1 then 8 E4M3 scale codes (block 16)."""

    name = "nvfp4"
    dim = 128
    segments = (64, 8)

    def encode(self, values: Tensor) -> Tensor:
        packed, scale_codes = formats.quantize_nvfp4(values, 16, check=False)
        return torch.cat([packed, scale_codes], dim=-1)

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        return formats.dequantize_nvfp4(entries[..., :64], entries[..., 64:], 16)


class Fp8KeyStorage(EntryStorage):
    """vLLM's Hopper indexer key, 132 B: 128 E4M3 codes then one fp32 scale (4 B)."""

    name = "fp8"
    dim = 128
    segments = (128, 4)

    def encode(self, values: Tensor) -> Tensor:
        return formats.encode_fp8_keys(values, check=False)

    def decode(self, entries: Tensor) -> Tensor:
        self._check_entries(entries)
        return formats.decode_fp8_keys(entries)


# ====================================================================================== factories
def kv_storage(name: str, dim: int = 512, rope_dim: int = 64) -> EntryStorage:
    """Codec of a main KV entry format (window ring and compressed pool). ``name`` ∈ ``KV_FORMATS``."""
    if name == "fp8_ds_mla":
        if (dim, rope_dim) != (512, 64):
            raise ValueError(f"fp8_ds_mla stores 448 + 64 = 512 dims; got dim={dim}, rope_dim={rope_dim}")
        return Fp8DsMlaStorage()
    if name == "fp8_per_token":
        return Fp8PerTokenStorage(dim, rope_dim)
    if name == "fp32":
        return Fp32Storage(dim)
    raise ValueError(f"unknown KV storage format {name!r}; choose one of {KV_FORMATS}")


def index_storage(name: str, dim: int = 128) -> EntryStorage:
    """Codec of an indexer key format (CSA layers). ``name`` ∈ ``INDEX_FORMATS``."""
    if name == "fp32":
        return Fp32Storage(dim)
    if name in ("mxfp4", "nvfp4", "fp8"):
        if dim != 128:
            raise ValueError(f"indexer key format {name!r} stores 128 dims; got dim={dim}")
        return {"mxfp4": Mxfp4KeyStorage, "nvfp4": Nvfp4KeyStorage, "fp8": Fp8KeyStorage}[name]()
    raise ValueError(f"unknown indexer key storage format {name!r}; choose one of {INDEX_FORMATS}")
