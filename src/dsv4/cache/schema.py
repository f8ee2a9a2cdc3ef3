"""Per-layer cache geometry (shapes and bytes, no tensors) and the capacity planner.

Two caches (SPEC §7.4, paper §3):

* the **compressed pool**, paged in blocks of ``block_size`` token positions: a CSA layer (ratio m) holds
  ``block_size // m`` main KV entries and as many indexer keys per block, an HCA layer (m') ``block_size // m'``
  KV entries; SWA layers have no pool;
* the **state cache**, fixed-size per request slot: the SWA ring of ``window`` KV entries (every layer kind) and
  the compressor tails of CSA / HCA layers (SPEC §4.4, §10 row 1).

Compressor tails (fp32; reset: kv 0, gate −inf):

* CSA main compressor (c = head_dim): current window ``tail_kv, tail_gate [m, 2c]`` (both halves of the
  projection of the ≤ m pending tokens, gates already biased), previous window's first half
  ``prev_kv, prev_gate [m, c]``;
* CSA indexer compressor: the same with c = index_head_dim (``index_tail_*``, ``index_prev_*``);
* HCA: ``tail_kv, tail_gate [m', c]``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..config import LayerKind, ModelConfig, require_config
from ..numerics import NumericsLike, resolve_numerics
from ..validate import require_int
from .errors import InvalidPlanError
from .storage import EntryStorage, index_storage, kv_storage

__all__ = [
    "TensorSpec",
    "LayerCacheSchema",
    "layer_schemas",
    "resolve_layers",
    "bytes_per_token",
    "blocks_for_tokens",
    "CapacityPlan",
    "plan_capacity",
]

PER_REQUEST = "request"
PER_BLOCK = "block"


@dataclass(frozen=True)
class TensorSpec:
    """One cache tensor of one layer.

    Attributes:
        name: tensor name (``ring``, ``ring_positions``, ``tail_kv`` …, ``kv_pages``, ``index_pages``).
        shape: shape of **one** row; the full tensor is ``[max_requests, *shape]`` (scope ``"request"``) or
            ``[num_blocks, *shape]`` (scope ``"block"``).
        dtype: torch dtype.
        scope: ``"request"`` (state cache, one row per slot) or ``"block"`` (compressed pool, one row per block).
        fill: initial / reset value of every element.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    scope: str
    fill: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one row."""
        return self.numel * self.dtype.itemsize


def blocks_for_tokens(num_tokens: int, min_ratio: int, block_size: int) -> int:
    """Logical blocks a request of ``num_tokens`` tokens needs: enough for its ``num_tokens // min_ratio``
    complete entries of the finest-ratio layer, ``ceil(((num_tokens // m_min) · m_min) / block_size)``.
    ``min_ratio`` 0 means no compressed layer: no blocks."""
    if min_ratio <= 0:
        return 0
    covered = (num_tokens // min_ratio) * min_ratio
    return -(-covered // block_size)


@dataclass(frozen=True)
class LayerCacheSchema:
    """Cache geometry of one layer.

    Attributes:
        layer_idx: layer index in ``cfg.compress_ratios`` (MTP blocks follow the main layers).
        kind: ``LayerKind.SWA`` / ``CSA`` / ``HCA``.
        ratio: compression ratio m (0 for SWA).
        block_size: token positions per pool block (a multiple of ``ratio``).
        window: SWA ring length (entries per state slot).
        head_dim: main KV entry width (512).
        rope_dim: rope dims at the end of an entry (64).
        index_head_dim: indexer key width (128); used by CSA only.
        kv_storage: codec of main KV entries (window ring and pool).
        index_storage: codec of indexer keys (CSA), else ``None``.
        cp_rank, cp_size: context parallelism (``dsv4.distributed``): this cache holds the compressed entries
            ``i ≡ cp_rank (mod cp_size)`` of every request — entry i of a block at local slot
            ``((i·m) % block_size) // m // cp_size`` — so a pool page has ``block_size // m // cp_size`` entries;
            ``(0, 1)``: every entry (one process).
    """

    layer_idx: int
    kind: LayerKind
    ratio: int
    block_size: int
    window: int
    head_dim: int
    rope_dim: int
    index_head_dim: int
    kv_storage: EntryStorage = field(compare=False, repr=False)
    index_storage: EntryStorage | None = field(compare=False, repr=False)
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if self.kind is LayerKind.SWA:
            if self.ratio != 0 or self.index_storage is not None:
                raise ValueError(f"layer {self.layer_idx}: an SWA layer has ratio 0 and no indexer storage")
        else:
            if self.ratio < 1:
                raise ValueError(f"layer {self.layer_idx}: {self.kind.name} layer needs a ratio >= 1, got {self.ratio}")
            if self.block_size < 1 or self.block_size % self.ratio:
                raise InvalidPlanError(
                    f"block_size {self.block_size} must be a positive multiple of layer {self.layer_idx}'s "
                    f"compression ratio {self.ratio} ({self.kind.name})"
                )
            if (self.kind is LayerKind.CSA) != (self.index_storage is not None):
                raise ValueError(f"layer {self.layer_idx}: exactly the CSA layers have indexer storage")
            if (self.block_size // self.ratio) % self.cp_size:
                raise InvalidPlanError(
                    f"block_size {self.block_size} holds {self.block_size // self.ratio} entries of layer "
                    f"{self.layer_idx} ({self.kind.name}, ratio {self.ratio}) per block, which {self.cp_size} "
                    f"context-parallel ranks cannot share equally: use a block_size that is a multiple of "
                    f"{self.ratio * self.cp_size}"
                )
        if not (isinstance(self.cp_size, int) and self.cp_size >= 1 and isinstance(self.cp_rank, int)
                and 0 <= self.cp_rank < self.cp_size):
            raise InvalidPlanError(f"cp_rank {self.cp_rank!r} / cp_size {self.cp_size!r}: need 0 <= cp_rank < cp_size")
        if self.window < 1:
            raise ValueError(f"layer {self.layer_idx}: window must be >= 1, got {self.window}")

    @classmethod
    def build(
        cls, cfg: ModelConfig, layer_idx: int, numerics: NumericsLike = "official", block_size: int = 256,
        cp_rank: int = 0, cp_size: int = 1,
    ) -> "LayerCacheSchema":
        """Geometry of ``cfg``'s layer ``layer_idx`` with ``numerics``' storage formats (``cp_rank`` of
        ``cp_size``: this rank's share of the pool)."""
        num = resolve_numerics(numerics)
        kind = cfg.layer_kind(layer_idx)
        return cls(
            layer_idx=layer_idx,
            kind=kind,
            ratio=cfg.ratio(layer_idx),
            block_size=block_size,
            window=cfg.window,
            head_dim=cfg.head_dim,
            rope_dim=cfg.rope_dim,
            index_head_dim=cfg.index_head_dim,
            kv_storage=kv_storage(num.kv_format, cfg.head_dim, cfg.rope_dim),
            index_storage=index_storage(num.index_format, cfg.index_head_dim) if kind is LayerKind.CSA else None,
            cp_rank=cp_rank,
            cp_size=cp_size,
        )

    # ---------------------------------------------------------------- geometry
    @property
    def is_compressed(self) -> bool:
        return self.kind is not LayerKind.SWA

    @property
    def entries_per_block(self) -> int:
        """Compressed entries per pool block held here (``block_size // m // cp_size``; 0 for SWA)."""
        return self.block_size // self.ratio // self.cp_size if self.ratio else 0

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one pool block's main KV page (0 for SWA)."""
        return self.kv_storage.page_bytes(self.entries_per_block) if self.is_compressed else 0

    @property
    def index_page_bytes(self) -> int:
        """Bytes of one pool block's indexer key page (CSA; else 0)."""
        return self.index_storage.page_bytes(self.entries_per_block) if self.index_storage is not None else 0

    @property
    def ring_page_bytes(self) -> int:
        """Bytes of one slot's SWA ring (``window`` KV entries as one page)."""
        return self.kv_storage.page_bytes(self.window)

    def tensor_specs(self) -> list[TensorSpec]:
        """Every tensor of this layer: per-request state first, then per-block pool pages."""
        f32, neg_inf = torch.float32, float("-inf")
        specs = [
            TensorSpec("ring", (self.ring_page_bytes,), torch.uint8, PER_REQUEST, 0),
            TensorSpec("ring_positions", (self.window,), torch.int32, PER_REQUEST, -1),
        ]
        m, c, ci = self.ratio, self.head_dim, self.index_head_dim
        if self.kind is LayerKind.CSA:
            for prefix, width in (("", c), ("index_", ci)):
                specs += [
                    TensorSpec(f"{prefix}tail_kv", (m, 2 * width), f32, PER_REQUEST, 0.0),
                    TensorSpec(f"{prefix}tail_gate", (m, 2 * width), f32, PER_REQUEST, neg_inf),
                    TensorSpec(f"{prefix}prev_kv", (m, width), f32, PER_REQUEST, 0.0),
                    TensorSpec(f"{prefix}prev_gate", (m, width), f32, PER_REQUEST, neg_inf),
                ]
        elif self.kind is LayerKind.HCA:
            specs += [
                TensorSpec("tail_kv", (m, c), f32, PER_REQUEST, 0.0),
                TensorSpec("tail_gate", (m, c), f32, PER_REQUEST, neg_inf),
            ]
        if self.is_compressed:
            specs.append(TensorSpec("kv_pages", (self.kv_page_bytes,), torch.uint8, PER_BLOCK, 0))
        if self.index_storage is not None:
            specs.append(TensorSpec("index_pages", (self.index_page_bytes,), torch.uint8, PER_BLOCK, 0))
        return specs

    @property
    def pool_bytes_per_block(self) -> int:
        """Bytes this layer adds to one pool block (page padding included)."""
        return sum(s.nbytes for s in self.tensor_specs() if s.scope == PER_BLOCK)

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of this layer's per-slot state (ring + positions + tails)."""
        return sum(s.nbytes for s in self.tensor_specs() if s.scope == PER_REQUEST)

    @property
    def bytes_per_token(self) -> float:
        """Compressed growth per token (SPEC §7.3, entry bytes, no padding): CSA (kv + index)/m, HCA kv/m', SWA 0;
        a context-parallel rank holds ``1 / cp_size`` of it."""
        if not self.is_compressed:
            return 0.0
        index = self.index_storage.entry_bytes if self.index_storage is not None else 0
        return (self.kv_storage.entry_bytes + index) / (self.ratio * self.cp_size)


def resolve_layers(cfg: ModelConfig, layers: Iterable[int] | None) -> list[int]:
    """``None`` → the main layers ``range(cfg.num_layers)`` (MTP excluded). Validates indices (ints, not bools or
    floats: ``TypeError``; in range: ``IndexError``) and duplicates (``ValueError``)."""
    if layers is None:
        return list(range(cfg.num_layers))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be an iterable of layer indices (int), got {type(layers).__name__} {layers!r}")
    out = list(layers)
    for i in out:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"layers must hold layer indices (int), got {type(i).__name__} {i!r}")
    out = [int(i) for i in out]
    for i in out:
        cfg.layer_kind(i)  # IndexError with a clear message if out of range
    if len(set(out)) != len(out):
        raise ValueError(f"layers contains duplicates: {out}")
    return out


def layer_schemas(
    cfg: ModelConfig,
    layers: Iterable[int] | None = None,
    numerics: NumericsLike = "official",
    block_size: int = 256,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> list[LayerCacheSchema]:
    """Schemas of ``layers`` (default: the main layers, MTP excluded), in the given order (``cp_rank`` of
    ``cp_size``: a context-parallel rank's share of the pool)."""
    return [LayerCacheSchema.build(cfg, i, numerics, block_size, cp_rank, cp_size) for i in resolve_layers(cfg, layers)]


def _lcm_ratio_block(cfg: ModelConfig, layers: Sequence[int]) -> int:
    ratios = [cfg.ratio(i) for i in layers if cfg.ratio(i)]
    return math.lcm(*ratios) if ratios else 1


def bytes_per_token(
    cfg: ModelConfig, layers: Iterable[int] | None = None, numerics: NumericsLike = "official"
) -> float:
    """Compressed-cache growth per token, summed over ``layers`` (default: main layers, MTP excluded).

    Windows and compressor state are fixed per request and excluded (SPEC §7.3): v4-flash official ≈ 3514 B,
    v4-pro ≈ 5031 B.
    """
    idx = resolve_layers(cfg, layers)
    return sum(s.bytes_per_token for s in layer_schemas(cfg, idx, numerics, _lcm_ratio_block(cfg, idx)))


@dataclass(frozen=True)
class CapacityPlan:
    """How many requests of a given context fit in a memory budget (pure arithmetic).

    Attributes:
        memory_bytes: the budget.
        context_len: tokens per request the plan is for.
        block_size: token positions per pool block.
        bytes_per_token: compressed growth per token (entry bytes, SPEC §7.3).
        fixed_bytes_per_request: state cache of one request (SWA rings, ring positions, compressor tails).
        pool_bytes_per_block: bytes of one pool block over all layers (page padding included).
        blocks_per_request: pool blocks one request of ``context_len`` tokens holds.
        bytes_per_request: ``fixed_bytes_per_request + blocks_per_request · pool_bytes_per_block``.
        max_requests: concurrent requests of ``context_len`` tokens that fit.
        max_context: the longest context (tokens) a single request can reach with the whole budget
            (capped at ``cfg.max_position``; 0 if not even its state fits).
    """

    memory_bytes: int
    context_len: int
    block_size: int
    bytes_per_token: float
    fixed_bytes_per_request: int
    pool_bytes_per_block: int
    blocks_per_request: int
    bytes_per_request: int
    max_requests: int
    max_context: int


def plan_capacity(
    cfg: ModelConfig,
    memory_bytes: int,
    context_len: int,
    layers: Iterable[int] | None = None,
    numerics: NumericsLike = "official",
    block_size: int = 256,
    cp_size: int = 1,
) -> CapacityPlan:
    """Capacity of a ``memory_bytes`` cache for requests of ``context_len`` tokens (block rounding and page padding
    included, exactly as ``HybridCache`` allocates). ``cp_size``: the cache of one of that many context-parallel
    ranks (the pool shared among them, the state replicated): ``memory_bytes`` is one rank's budget."""
    require_config(cfg)
    require_int("memory_bytes", memory_bytes, 0, error=InvalidPlanError)
    require_int("context_len", context_len, 0, cfg.max_position, error=InvalidPlanError)
    require_int("block_size", block_size, 1, error=InvalidPlanError)
    require_int("cp_size", cp_size, 1, error=InvalidPlanError)
    schemas = layer_schemas(cfg, layers, numerics, block_size, 0, cp_size)
    fixed = sum(s.state_bytes_per_request for s in schemas)
    per_block = sum(s.pool_bytes_per_block for s in schemas)
    ratios = [s.ratio for s in schemas if s.ratio]
    m_min = min(ratios) if ratios else 0
    blocks = blocks_for_tokens(context_len, m_min, block_size)
    per_request = fixed + blocks * per_block
    max_requests = memory_bytes // per_request if per_request else 0
    if memory_bytes < fixed:
        max_context = 0
    elif not m_min:
        max_context = cfg.max_position
    else:
        # A request of `end` tokens needs ceil(((end // m_min)·m_min) / bs) ≤ n blocks ⇔ end ≤ n·bs + m_min − 1.
        n = (memory_bytes - fixed) // per_block
        max_context = min(n * block_size + m_min - 1, cfg.max_position)
    return CapacityPlan(
        memory_bytes=memory_bytes,
        context_len=context_len,
        block_size=block_size,
        bytes_per_token=sum(s.bytes_per_token for s in schemas),
        fixed_bytes_per_request=fixed,
        pool_bytes_per_block=per_block,
        blocks_per_request=blocks,
        bytes_per_request=per_request,
        max_requests=max_requests,
        max_context=max_context,
    )
