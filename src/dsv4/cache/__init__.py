"""The hybrid KV cache: compressed pool (paged blocks) + per-request state (SWA ring, compressor tails).

Modules, one job each: ``storage`` (entry codecs over uint8 pages), ``schema`` (per-layer geometry, bytes,
capacity planning), ``allocator`` (block free list + refcounts), ``state`` (per-slot tensors), ``pool`` (paged
tensors), ``batch`` (``StepBatch``), ``manager`` (``HybridCache``) with ``layer_view`` (``LayerCache``),
``plan_check`` (a step's plan validated), ``snapshot`` (whole-cache snapshot and comparison) and ``invariants``,
``steps`` (binds a batch to its cache state, counts the layers that run it), ``preempt`` (save / restore a request),
``integrity`` (snapshot checksum and value checks), ``prefix`` (prefix caching: shared prompt blocks + state
snapshots at block boundaries, ``prefix_states``: the snapshot rows), ``errors``.
"""

from .allocator import BlockAllocator
from .batch import StepBatch, build_step_batch, visible_entries
from .errors import (
    CacheFullError,
    CorruptSnapshotError,
    DuplicateRequestError,
    IncompatibleSnapshotError,
    InvalidPlanError,
    NonFiniteError,
    StaleBatchError,
    StepOrderError,
    UnknownRequestError,
)
from .manager import CacheSnapshot, HybridCache, LayerCache, RequestRecord
from .pool import CompressedPool
from .preempt import CacheGeometry, RequestSnapshot
from .prefix import PrefixSnapshot
from .schema import (
    CapacityPlan,
    LayerCacheSchema,
    TensorSpec,
    blocks_for_tokens,
    bytes_per_token,
    layer_schemas,
    plan_capacity,
)
from .state import StateCache
from .steps import StepLedger, StepTicket
from .storage import (
    EntryStorage,
    Fp8DsMlaStorage,
    Fp8KeyStorage,
    Fp8PerTokenStorage,
    Fp32Storage,
    Mxfp4KeyStorage,
    Nvfp4KeyStorage,
    index_storage,
    kv_storage,
)

__all__ = [
    "BlockAllocator",
    "CacheFullError",
    "CacheSnapshot",
    "CapacityPlan",
    "CompressedPool",
    "CorruptSnapshotError",
    "DuplicateRequestError",
    "IncompatibleSnapshotError",
    "CacheGeometry",
    "RequestSnapshot",
    "EntryStorage",
    "Fp32Storage",
    "Fp8DsMlaStorage",
    "Fp8KeyStorage",
    "Fp8PerTokenStorage",
    "HybridCache",
    "InvalidPlanError",
    "LayerCache",
    "LayerCacheSchema",
    "PrefixSnapshot",
    "Mxfp4KeyStorage",
    "NonFiniteError",
    "Nvfp4KeyStorage",
    "RequestRecord",
    "StaleBatchError",
    "StateCache",
    "StepBatch",
    "StepLedger",
    "StepOrderError",
    "StepTicket",
    "TensorSpec",
    "UnknownRequestError",
    "blocks_for_tokens",
    "build_step_batch",
    "bytes_per_token",
    "index_storage",
    "kv_storage",
    "layer_schemas",
    "plan_capacity",
    "visible_entries",
]
