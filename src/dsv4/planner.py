"""Memory planner (``dsv4 plan``): cache bytes per token and per request, and what fits a memory budget.

Built on ``dsv4.cache.schema`` (the same geometry ``HybridCache`` allocates), side by side for several storage
formats:

* ``official`` — the DeepSeek reference: 584-B KV entries (448 FP8 E4M3 + 7 UE8M0 scales + 64 BF16 rope dims,
  FlashMLA / vLLM ``fp8_ds_mla`` layout) and 68-B MXFP4 indexer keys (SPEC §7.2);
* ``hopper`` — what serving engines use on Hopper today: the same 584-B entries, 132-B FP8 indexer keys
  (128 E4M3 + one FP32 scale; vLLM / SGLang, SPEC §11);
* ``exact`` — FP32 everywhere (2048-B entries, 512-B keys): the ``exact`` numerics;
* ``prototype`` — the seed prototype's per-token FP8 (580 B) and NVFP4 keys (72 B);
* ``dense-bf16`` — no compression and no window: every layer keeps every token's 512-dim KV in BF16 (K ≡ V, one
  KV head): 1024 B per token and layer, no fixed state.

Assumptions (also printed by ``dsv4 plan``): the main layers only (the MTP block is a draft layer that engines
usually cache separately; include it with ``layers``); cache only (no weights, activations or workspace);
``block_size``-token pool blocks with block rounding and page padding exactly as ``HybridCache`` allocates;
every request holds its own blocks (no prefix sharing); per-request fixed state = the SWA ring of every layer
(``window`` entries in the KV format, plus int32 positions) and the CSA/HCA compressor tails in FP32 (SPEC §7.4).

"SPEC §N" is section N of ``docs/spec.md``.

``cp_size`` plans the cache of one GPU of a context-parallel group (``dsv4.distributed``): the pool of every
request is shared among the ``cp_size`` GPUs, the fixed state is replicated. ``plan_parallel`` sets a
``tp × cp`` split's per-GPU memory (cache and attention weights) against one GPU's.

``plan_prefix_sharing`` adds prefix caching (``dsv4.cache.prefix``): requests in groups sharing a prompt prefix
hold its whole blocks once per group, plus one state snapshot at its end (the live state at a block boundary:
rings and CSA's previous-window halves), so more requests fit the same memory and each computes only the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .cache import InvalidPlanError, blocks_for_tokens, layer_schemas, plan_capacity
from .cache.prefix import prefix_state_bytes
from .cache.schema import resolve_layers
from .config import LayerKind, ModelConfig, require_config
from .engine.runner import DENSE_BF16_BYTES_PER_TOKEN_LAYER
from .numerics import Numerics
from .validate import require_int

__all__ = [
    "DEFAULT_FORMATS", "FORMATS", "FormatPlan", "KindRow", "ParallelPlan", "PrefixPlan", "attention_weight_bytes",
    "plan_formats", "plan_parallel", "plan_prefix_sharing", "request_bytes",
]


@dataclass(frozen=True)
class StorageFormat:
    """A named (KV format, indexer-key format) pair; ``numerics is None`` means the dense BF16 baseline."""

    name: str
    description: str
    numerics: Numerics | None


FORMATS: dict[str, StorageFormat] = {
    "official": StorageFormat("official", "584-B FP8 entries + 68-B MXFP4 indexer keys (DeepSeek reference)",
                              Numerics.official()),
    "hopper": StorageFormat("hopper", "584-B FP8 entries + 132-B FP8 indexer keys (vLLM / SGLang on Hopper)",
                            Numerics.official().with_formats(index_format="fp8")),
    "exact": StorageFormat("exact", "FP32 entries (2048 B) + FP32 indexer keys (512 B)", Numerics.exact()),
    "prototype": StorageFormat("prototype", "580-B per-token FP8 entries + 72-B NVFP4 keys (seed prototype)",
                               Numerics.official().with_formats(kv_format="fp8_per_token", index_format="nvfp4")),
    "dense-bf16": StorageFormat("dense-bf16", "no compression, no window: 1024 B per token and layer (BF16, K = V)",
                                None),
}
DEFAULT_FORMATS = ("official", "hopper", "exact", "dense-bf16")


@dataclass(frozen=True)
class KindRow:
    """One layer kind under one format.

    Attributes:
        kind: SWA / CSA / HCA.
        layers: how many layers of this kind are counted.
        ratio: compression ratio (0 for SWA).
        kv_entry_bytes / index_entry_bytes: bytes of one stored KV entry / indexer key (0 if none).
        bytes_per_token: growth per token per layer, ``(kv + index) / m`` (SPEC §7.3; 0 for SWA).
        state_bytes: fixed per-request state of one layer (ring, positions, compressor tails).
        pool_bytes_per_block: pool bytes of one layer per block (page padding included).
    """

    kind: str
    layers: int
    ratio: int
    kv_entry_bytes: int
    index_entry_bytes: int
    bytes_per_token: float
    state_bytes: int
    pool_bytes_per_block: int


@dataclass
class FormatPlan:
    """Memory of one storage format for requests of ``context_len`` tokens and a ``memory_bytes`` budget.

    Attributes:
        format: ``StorageFormat`` name.
        bytes_per_token: compressed growth per token over all counted layers (entry bytes, no padding).
        fixed_bytes_per_request: per-request state over all layers.
        bytes_per_request: at ``context_len`` (fixed + blocks · block bytes; dense: context · per-token).
        spec_estimate: ``bytes_per_token · context_len`` (the SPEC §7.3 figure, without fixed state).
        max_requests: requests of ``context_len`` that fit ``memory_bytes``.
        max_context: longest single request that fits ``memory_bytes`` (capped at ``max_position``).
        kinds: per-kind breakdown (empty for dense).
    """

    format: str
    description: str
    bytes_per_token: float
    fixed_bytes_per_request: int
    bytes_per_request: int
    spec_estimate: float
    max_requests: int
    max_context: int
    blocks_per_request: int = 0
    pool_bytes_per_block: int = 0
    kinds: list[KindRow] = field(default_factory=list)


def request_bytes(
    cfg: ModelConfig, context_len: int, fmt: str, layers: Iterable[int] | None = None, block_size: int = 256
) -> int:
    """Cache bytes of one request of ``context_len`` tokens in format ``fmt`` (block rounding included)."""
    require_config(cfg)
    require_int("context_len", context_len, 0, cfg.max_position, error=InvalidPlanError)
    require_int("block_size", block_size, 1, error=InvalidPlanError)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {sorted(FORMATS)}")
    f = FORMATS[fmt]
    idx = resolve_layers(cfg, layers)
    if f.numerics is None:
        return context_len * len(idx) * DENSE_BF16_BYTES_PER_TOKEN_LAYER
    schemas = layer_schemas(cfg, idx, f.numerics, block_size)
    fixed = sum(s.state_bytes_per_request for s in schemas)
    per_block = sum(s.pool_bytes_per_block for s in schemas)
    ratios = [s.ratio for s in schemas if s.ratio]
    return fixed + blocks_for_tokens(context_len, min(ratios) if ratios else 0, block_size) * per_block


def plan_formats(
    cfg: ModelConfig,
    context_len: int,
    memory_bytes: int,
    layers: Iterable[int] | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    block_size: int = 256,
    cp_size: int = 1,
) -> list[FormatPlan]:
    """One ``FormatPlan`` per format (see the module docstring for what is counted); ``cp_size`` > 1: one GPU of a
    context-parallel group (its share of every request's compressed entries, the dense baseline's tokens shared
    likewise).

    Raises ``TypeError`` / ``ValueError`` (``InvalidPlanError``) naming the argument: ``cfg`` not a
    ``ModelConfig``, ``context_len`` / ``memory_bytes`` / ``block_size`` not an int in range, an unknown format."""
    require_config(cfg)
    require_int("context_len", context_len, 0, cfg.max_position, error=InvalidPlanError)
    require_int("memory_bytes", memory_bytes, 0, error=InvalidPlanError)
    require_int("block_size", block_size, 1, error=InvalidPlanError)
    require_int("cp_size", cp_size, 1, error=InvalidPlanError)
    if isinstance(formats, str):
        raise TypeError(f"formats must be a sequence of format names, got the str {formats!r}")
    idx = resolve_layers(cfg, layers)
    out = []
    for name in formats:
        if name not in FORMATS:
            raise ValueError(f"unknown format {name!r}; choose from {sorted(FORMATS)}")
        f = FORMATS[name]
        if f.numerics is None:
            per_tok = len(idx) * DENSE_BF16_BYTES_PER_TOKEN_LAYER / cp_size
            per_req = math.ceil(context_len * per_tok)
            out.append(FormatPlan(
                format=name, description=f.description, bytes_per_token=float(per_tok), fixed_bytes_per_request=0,
                bytes_per_request=per_req, spec_estimate=float(per_req),
                max_requests=memory_bytes // per_req if per_req else 0,
                max_context=min(int(memory_bytes // per_tok), cfg.max_position) if per_tok else cfg.max_position,
            ))
            continue
        cap = plan_capacity(cfg, memory_bytes, context_len, idx, f.numerics, block_size, cp_size)
        schemas = layer_schemas(cfg, idx, f.numerics, block_size, 0, cp_size)
        kinds = []
        for kind in LayerKind:
            ks = [s for s in schemas if s.kind is kind]
            if not ks:
                continue
            s = ks[0]
            kinds.append(KindRow(
                kind=kind.name, layers=len(ks), ratio=s.ratio, kv_entry_bytes=s.kv_storage.entry_bytes,
                index_entry_bytes=s.index_storage.entry_bytes if s.index_storage is not None else 0,
                bytes_per_token=s.bytes_per_token, state_bytes=s.state_bytes_per_request,
                pool_bytes_per_block=s.pool_bytes_per_block,
            ))
        out.append(FormatPlan(
            format=name, description=f.description, bytes_per_token=cap.bytes_per_token,
            fixed_bytes_per_request=cap.fixed_bytes_per_request, bytes_per_request=cap.bytes_per_request,
            spec_estimate=cap.bytes_per_token * context_len, max_requests=cap.max_requests, max_context=cap.max_context,
            blocks_per_request=cap.blocks_per_request, pool_bytes_per_block=cap.pool_bytes_per_block, kinds=kinds,
        ))
    return out


def attention_weight_bytes(cfg: ModelConfig, layers: Iterable[int] | None = None, tp_size: int = 1,
                           act_bytes: int = 2) -> int:
    """Bytes of the attention weights of ``layers`` on one of ``tp_size`` tensor-parallel GPUs, as the engine holds
    them: the FP8 projections as the checkpoints store them (1 B per value + an FP32 scale per 128 × 128 block),
    the other matrices at ``act_bytes`` (BF16 for the official numerics), vectors and position biases in FP32. A
    rank holds ``H/tp`` heads' ``wq_b`` rows and sinks and ``G/tp`` groups' ``wo_a`` rows and ``wo_b`` columns;
    the rest whole (``dsv4.distributed.sharding``)."""
    require_config(cfg)
    require_int("tp_size", tp_size, 1)

    def fp8(rows: int, cols: int) -> int:
        return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)

    d, D, q, o = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, cfg.o_lora_rank
    H, G = cfg.num_heads // tp_size, cfg.o_groups // tp_size
    HI, cI = cfg.index_n_heads, cfg.index_head_dim
    total = 0
    for li in resolve_layers(cfg, layers):
        n = fp8(q, d) + fp8(H * D, q) + fp8(D, d) + fp8(d, G * o) + act_bytes * G * o * (cfg.num_heads * D // cfg.o_groups)
        n += 4 * (q + D + H)
        kind = cfg.layer_kind(li)
        if kind is LayerKind.CSA:
            n += fp8(HI * cI, q) + act_bytes * HI * d
            for c in (D, cI):  # the main and the indexer's compressor: wkv, wgate [2c, d]; ape [m, 2c]; norm [c]
                n += act_bytes * 2 * 2 * c * d + 4 * (cfg.csa_ratio * 2 * c + c)
        elif kind is LayerKind.HCA:
            n += act_bytes * 2 * D * d + 4 * (cfg.hca_ratio * D + D)
        total += n
    return total


@dataclass(frozen=True)
class ParallelPlan:
    """Per-GPU memory of a ``tp × cp`` split against one GPU (one storage format, requests of ``context_len``).

    Attributes:
        tp, cp: tensor- and context-parallel group sizes (``tp · cp`` GPUs serve every request).
        weights_per_gpu / weights_one_gpu: attention weights (``attention_weight_bytes``).
        request_per_gpu / request_one_gpu: cache of one request (the pool divided over the CP group, the state
            replicated; TP replicates the cache).
        max_requests_per_gpu / max_requests_one_gpu: requests of ``context_len`` whose cache fits the budget.
        max_context_per_gpu / max_context_one_gpu: the longest single request that fits the budget.
    """

    tp: int
    cp: int
    context_len: int
    memory_bytes: int
    format: str
    weights_per_gpu: int
    weights_one_gpu: int
    request_per_gpu: int
    request_one_gpu: int
    max_requests_per_gpu: int
    max_requests_one_gpu: int
    max_context_per_gpu: int
    max_context_one_gpu: int


def plan_parallel(cfg: ModelConfig, context_len: int, memory_bytes: int, layers: Iterable[int] | None = None,
                  tp_size: int = 1, cp_size: int = 1, fmt: str = "official", block_size: int = 256) -> ParallelPlan:
    """``ParallelPlan`` of a ``tp_size × cp_size`` split, ``memory_bytes`` of cache per GPU. Raises ``ValueError``
    when ``tp_size`` does not divide the output groups or ``block_size`` cannot be shared by ``cp_size`` ranks."""
    from .distributed.sharding import check_tp_size

    check_tp_size(cfg, tp_size)
    idx = resolve_layers(cfg, layers)
    one, per_gpu = (plan_formats(cfg, context_len, memory_bytes, idx, [fmt], block_size, c)[0] for c in (1, cp_size))
    return ParallelPlan(
        tp=tp_size, cp=cp_size, context_len=context_len, memory_bytes=memory_bytes, format=fmt,
        weights_per_gpu=attention_weight_bytes(cfg, idx, tp_size), weights_one_gpu=attention_weight_bytes(cfg, idx),
        request_per_gpu=per_gpu.bytes_per_request, request_one_gpu=one.bytes_per_request,
        max_requests_per_gpu=per_gpu.max_requests, max_requests_one_gpu=one.max_requests,
        max_context_per_gpu=per_gpu.max_context, max_context_one_gpu=one.max_context,
    )


@dataclass(frozen=True)
class PrefixPlan:
    """Prefix sharing for requests of ``context_len`` tokens whose first ``shared_prefix`` are shared per group.

    Attributes:
        shared_blocks: whole blocks a request takes from the cache (``min(shared_prefix, context_len − 1)`` tokens,
            rounded down to blocks: a hit never covers a prompt's last token).
        shared_tokens: ``shared_blocks · block_size``, the prompt tokens a hit does not compute.
        snapshot_bytes: one state snapshot (every layer's ring + CSA previous-window halves).
        bytes_per_prefix: one cached prefix: its blocks + its snapshot.
        private_bytes_per_request: fixed state + the blocks past the shared ones.
        max_requests_shared: requests that fit with ``groups`` cached prefixes.
        max_requests_private: requests that fit when every request holds its own blocks.
        prefill_fraction: prompt tokens computed with sharing / without, for ``requests`` requests (the first of
            each group computes its prefix, the others only the rest).
    """

    shared_prefix: int
    groups: int
    shared_blocks: int
    shared_tokens: int
    snapshot_bytes: int
    bytes_per_prefix: int
    private_bytes_per_request: int
    max_requests_shared: int
    max_requests_private: int
    prefill_fraction: float


def plan_prefix_sharing(
    cfg: ModelConfig,
    memory_bytes: int,
    context_len: int,
    shared_prefix: int,
    groups: int = 1,
    requests: int | None = None,
    layers: Iterable[int] | None = None,
    numerics: Numerics | str = "official",
    block_size: int = 256,
) -> PrefixPlan:
    """Memory and prefill work with prefix caching (see ``PrefixPlan``); ``requests`` defaults to
    ``max_requests_shared``."""
    if not 0 <= shared_prefix <= context_len or groups < 1:
        raise ValueError(f"need 0 <= shared_prefix <= context_len and groups >= 1, got {shared_prefix}, {groups}")
    idx = resolve_layers(cfg, layers)
    schemas = layer_schemas(cfg, idx, numerics, block_size)
    fixed = sum(s.state_bytes_per_request for s in schemas)
    per_block = sum(s.pool_bytes_per_block for s in schemas)
    ratios = [s.ratio for s in schemas if s.ratio]
    blocks = blocks_for_tokens(context_len, min(ratios) if ratios else 0, block_size)
    k = min(shared_prefix, max(context_len - 1, 0)) // block_size
    k_blocks = min(k, blocks)
    snap = prefix_state_bytes(schemas)
    per_prefix = k_blocks * per_block + snap
    private = fixed + (blocks - k_blocks) * per_block
    left = memory_bytes - groups * per_prefix
    shared_n = left // private if left > 0 and private else 0
    private_n = memory_bytes // (fixed + blocks * per_block) if fixed + blocks * per_block else 0
    n = shared_n if requests is None else requests
    computed = n * context_len - max(n - groups, 0) * k * block_size
    return PrefixPlan(
        shared_prefix=shared_prefix, groups=groups, shared_blocks=k_blocks, shared_tokens=k * block_size,
        snapshot_bytes=snap, bytes_per_prefix=per_prefix, private_bytes_per_request=private,
        max_requests_shared=shared_n, max_requests_private=private_n,
        prefill_fraction=computed / (n * context_len) if n and context_len else 1.0,
    )


def context_grid(max_context: int, points_per_octave: int = 4, start: int = 1024) -> list[int]:
    """Log-spaced context lengths from ``start`` to ``max_context`` (for plots)."""
    out, k = [], 0
    while True:
        v = int(round(start * 2 ** (k / points_per_octave)))
        if v >= max_context:
            out.append(max_context)
            return out
        out.append(v)
        k += 1


def plot_memory(
    cfg: ModelConfig,
    path: str,
    formats: Sequence[str] = DEFAULT_FORMATS,
    layers: Iterable[int] | None = None,
    block_size: int = 256,
    memory_bytes: int | None = None,
    max_context: int | None = None,
) -> None:
    """Draw per-request cache memory against context length (log–log) for each format into ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'dsv4[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("--plot needs matplotlib: pip install 'dsv4[plot]' (or pip install matplotlib)") from e
    idx = resolve_layers(cfg, layers)
    grid = context_grid(max_context or cfg.max_position)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in formats:
        ys = [request_bytes(cfg, L, name, idx, block_size) / 2**30 for L in grid]
        ax.plot(grid, ys, label=f"{name}: {FORMATS[name].description}", linewidth=1.8)
    if memory_bytes:
        ax.axhline(memory_bytes / 2**30, color="grey", linestyle="--", linewidth=1, label=f"budget {memory_bytes / 2**30:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache per request (GiB)")
    ax.set_title(f"{cfg.name}: {len(idx)} layers, {block_size}-token blocks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.50 KiB"``."""
    if not math.isfinite(n):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def parse_bytes(text: str | int) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"512MiB"``, ``"1e9"``, ``1024`` → bytes (GB = 10⁹, GiB = 2³⁰)."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise TypeError(f"byte size must be an int or a str like '80GiB', got {type(text).__name__} {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size must be >= 0, got {text}")
        return text
    s = str(text).strip().replace(" ", "").lower()
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "b": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, mult = s, 1
    try:
        v = float(num) * mult
    except ValueError:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 80GiB, 512MiB, 4e9)") from None
    if not math.isfinite(v):
        raise ValueError(f"byte size must be a finite number, got {text!r} (examples: 80GiB, 512MiB, 4e9)")
    if v < 0:
        raise ValueError(f"byte size must be >= 0, got {text!r}")
    return int(v)
