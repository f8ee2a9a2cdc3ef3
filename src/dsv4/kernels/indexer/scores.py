"""Index scores over the paged indexer keys, in Triton (SPEC §5): every key format, and the interpreter.

``_scores_kernel`` computes ``I[t, s] = Σ_h w[t, h] · relu(q[t, h] · K[s])`` for every query of a request against that
request's keys in the paged pool (through its block table), rounded once to the score dtype. Keys are a tile's rows
(MMA ``M``), the heads of ``QT`` queries its columns (``N = QT · HP``), the 128 channels the reduction. The relu and
head weight run as ``(x + |x|) · w/2`` (``_head_sum``): the same bits, on the FMA pipe.

Key formats (``FORMAT``):

* ``FMT_MXFP4`` (the official 68-B key): codes converted to E4M3 bytes exactly in registers, their block scales
  folded in (``fp8_operands``), one FP8 MMA per tile; the key scale applied after the head sum.
* ``FMT_FP8`` (vLLM's 132-B key: 128 E4M3 codes + an fp32 scale): codes go to the MMA as they are; ``q8[t, 0]`` /
  ``q8[t, 1]`` are the first / last 64 channels; the per-key and per-query fp32 scales are applied like the folded
  MXFP4 scales.
* ``FMT_FP32`` (exact numerics, 512-B keys): an IEEE fp32 ``tl.dot`` (no TF32), ``qf[t, 0]`` / ``qf[t, 1]`` = first /
  last 64 channels.

Memory pipeline. Where pages hold a multiple of the key tile (``PAGE_VECTOR``; block size 256: one page per 64-key
tile), a program reads its split's block-table entries once, before its loop, and takes each tile's page from
registers: no load feeds the address of a key tile, so Triton's pipeliner copies the tile's codes two tiles ahead
(``NUM_STAGES=3``), and the tile's scales (2 bytes per thread, too small for an asynchronous copy) are loaded into
registers one tile ahead. Smaller pages take a per-row block-table gather.

MXFP4 keys on Hopper run the Gluon kernel instead (``scores_sm90``, same numerics); ``index_scores`` launches what
the plan (``scores_plan``) chose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..device import interpreting
from . import scores_sm90
from .fp8_operands import block_lookup_tables, pow2_from_byte, unpack_keys_asm, unpack_keys_int

__all__ = ["FMT_MXFP4", "FMT_FP8", "FMT_FP32", "index_scores", "pick_scores_config"]

FMT_MXFP4 = 0
FMT_FP8 = 1
FMT_FP32 = 2


# ------------------------------------------------------------------------------------------------ scores
@triton.jit
def _head_sum(ka, kb, qa, qb, w_half, BLOCK_N: tl.constexpr, QT: tl.constexpr, HP: tl.constexpr,
              IEEE: tl.constexpr):
    """``Σ_h w_h · relu(q_h · k)`` of a key tile (``ka`` / ``kb``: ``[BLOCK_N, 64]``) against the queries (``qa`` /
    ``qb``: ``[64, QT · HP]``): ``[BLOCK_N, QT]`` fp32. ``w_half``: ``[QT · HP]`` half the head weights.

    ``relu(x) · w`` is computed as ``(x + |x|) · (w / 2)``: the same bits (``x + |x|`` is ``2x`` or ``+0`` exactly,
    halving ``w`` is exact), but an add with an operand modifier on the FMA pipe instead of a max on the
    integer/logic pipe that the key conversion keeps busy."""
    if IEEE:
        acc = tl.dot(ka, qa, input_precision="ieee")
        acc = tl.dot(kb, qb, acc, input_precision="ieee")
    else:
        acc = tl.dot(ka, qa)
        acc = tl.dot(kb, qb, acc)
    p = (acc + tl.abs(acc)) * w_half[None, :]
    return tl.sum(tl.reshape(p, (BLOCK_N, QT, HP)), axis=2)


#: ``_store_scores``' store of one element (``SIZE`` bytes, ``BITS`` bits) at ``$1 + SIZE · $2`` where ``$4`` is
#: nonzero
_STORE_SCORE_PTX = """{ .reg .pred p; .reg .b64 a;
    setp.ne.b32 p, $4, 0;
    mad.lo.s64 a, $2, SIZE, $1;
    @p st.global.bBITS [a], $3;
    mov.b32 $0, 0; }"""
_STORE_B16_PTX: tl.constexpr = tl.constexpr(_STORE_SCORE_PTX.replace("SIZE", "2").replace("BITS", "16"))
_STORE_B32_PTX: tl.constexpr = tl.constexpr(_STORE_SCORE_PTX.replace("SIZE", "4").replace("BITS", "32"))


@triton.jit
def _store_scores(out_ptr, offsets, scores, mask):
    """``out_ptr[offsets] = scores`` (rounded to the buffer's dtype) where ``mask``, as inline PTX in the scores'
    own register layout: ``tl.store`` would first move the tile through shared memory (two barriers) into a
    coalesced layout. The MMA layout holds each score in four lanes; each stores the same value."""
    base = out_ptr.to(tl.int64, bitcast=True) + tl.zeros_like(offsets)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = scores.to(tl.bfloat16).to(tl.int16, bitcast=True)
        asm: tl.constexpr = _STORE_B16_PTX
        constraints: tl.constexpr = "=r,l,l,h,r"
    else:
        bits = scores.to(tl.float32).to(tl.int32, bitcast=True)
        asm: tl.constexpr = _STORE_B32_PTX
        constraints: tl.constexpr = "=r,l,l,r,r"
    tl.inline_asm_elementwise(asm=asm, constraints=constraints, args=[base, offsets, bits, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mxfp4_scales(page, slot, live, ENTRIES: tl.constexpr):
    """int32 ``[BLOCK_N, 4]`` biased UE8M0 block exponents of MXFP4 keys: ``page`` ``[BLOCK_N]`` pointers to each
    row's page (``ENTRIES × 64`` packed E2M1 bytes, then ``ENTRIES × 4`` scale bytes), ``slot`` ``[BLOCK_N]`` the
    rows' entry slots, ``live`` ``[BLOCK_N]`` rows to read (the others read as 1)."""
    e = tl.load(page[:, None] + ENTRIES * 64 + slot[:, None] * 4 + tl.arange(0, 4)[None, :], mask=live[:, None],
                other=1)
    return e.to(tl.int32)


@triton.jit
def _scores_kernel(
    pages_ptr,                  # uint8 [num_blocks, PAGE_BYTES]: the layer's indexer key pages
    bt_ptr, bt_stride,          # int32 [B, max_blocks]: block tables
    cu_ptr,                     # int32 [B + 1]: token offsets of each request
    vis_ptr,                    # int64 [T]: entries visible to each token, (pos + 1) // m
    q_ptr,                      # [T, 2, HP, 64] query operand (uint8 E4M3 bytes, or fp32 for FMT_FP32)
    w_ptr,                      # fp32 [T, HP]: head weight · query scale (0 for padded heads)
    out_ptr, out_stride,        # [T, out_stride] scores (score dtype); only s < visible[t] are written
    PAGE_BYTES, TILES_PER_SPLIT,
    M_RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, ENTRIES: tl.constexpr,
    HP: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr,
    FORMAT: tl.constexpr, USE_ASM: tl.constexpr, NUM_STAGES: tl.constexpr,
    PAGE_VECTOR: tl.constexpr, MAX_TPS: tl.constexpr,
    HOST_BOUND: tl.constexpr,
    TPS_HINT: tl.constexpr,  # interpreter: tiles per split as a loop bound (no data-dependent loops there)
):
    split = tl.program_id(0)
    chunk = tl.program_id(1)
    b = tl.program_id(2)
    tok0 = tl.load(cu_ptr + b)
    n_tok = tl.load(cu_ptr + b + 1) - tok0
    t0 = tok0 + chunk * QT
    nq = tl.minimum(n_tok - chunk * QT, QT)
    if nq <= 0:
        return
    # The chunk's last query sees the most entries (positions increase within a request).
    n_keys = tl.load(vis_ptr + t0 + nq - 1).to(tl.int32)
    tile_lo = split * TILES_PER_SPLIT
    tile_hi = tl.minimum(tile_lo + TILES_PER_SPLIT, tl.cdiv(n_keys, BLOCK_N))
    if tile_lo >= tile_hi:
        return

    NQ: tl.constexpr = QT * HP
    col = tl.arange(0, NQ)
    qi = col // HP  # query of each column
    hh = col % HP
    qrow = t0 + qi
    qlive = qi < nq
    half = tl.arange(0, 64)
    q_off = qrow[:, None] * (2 * HP * 64) + hh[:, None] * 64 + half[None, :]
    if FORMAT == 2:
        qa = tl.trans(tl.load(q_ptr + q_off, mask=qlive[:, None], other=0.0))  # [64, NQ] fp32
        qb = tl.trans(tl.load(q_ptr + q_off + HP * 64, mask=qlive[:, None], other=0.0))
    else:
        qa = tl.trans(tl.load(q_ptr + q_off, mask=qlive[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        qb = tl.trans(tl.load(q_ptr + q_off + HP * 64, mask=qlive[:, None], other=0).to(tl.float8e4nv, bitcast=True))
    w_half = tl.load(w_ptr + qrow * HP + hh, mask=qlive, other=0.0) * 0.5  # [NQ], see _head_sum
    # visible count per query, for the causal mask of the stores
    vis_q = tl.load(vis_ptr + t0 + tl.arange(0, QT), mask=tl.arange(0, QT) < nq, other=0).to(tl.int32)

    rows = tl.arange(0, BLOCK_N)
    zero_rows = tl.zeros([BLOCK_N], dtype=tl.int64)  # a tile's page pointer broadcast over its rows
    bt_row = bt_ptr + b * bt_stride
    if PAGE_VECTOR:
        # Every tile lies in one page (pages hold a multiple of BLOCK_N entries): the split's block-table entries are
        # read once, before the loop, and a tile's page is picked from registers — no load feeds the address of the
        # tile's keys, so the pipeliner can issue them NUM_STAGES − 1 tiles ahead. MXFP4 scales (2 bytes per thread,
        # too small for an asynchronous copy) are loaded into registers a tile ahead.
        tiles = tl.arange(0, MAX_TPS)
        tile_pages = tl.load(bt_row + ((tile_lo + tiles) * BLOCK_N) // ENTRIES, mask=tile_lo + tiles < tile_hi,
                             other=0)
        if FORMAT == 0:
            blk0 = tl.sum(tl.where(tiles == 0, tile_pages, 0)).to(tl.int64)
            e_next = _mxfp4_scales(pages_ptr + blk0 * PAGE_BYTES + zero_rows, (tile_lo * BLOCK_N) % ENTRIES + rows,
                                   tile_lo * BLOCK_N + rows < n_keys, ENTRIES)
    for it in tl.range(0, TPS_HINT if HOST_BOUND else tile_hi - tile_lo, num_stages=NUM_STAGES):
        tile = tile_lo + it
        idx = tile * BLOCK_N + rows
        kl = idx < n_keys
        if PAGE_VECTOR:
            blk = tl.sum(tl.where(tiles == it, tile_pages, 0)).to(tl.int64)
            slot = (tile * BLOCK_N) % ENTRIES + rows
            page = pages_ptr + blk * PAGE_BYTES + zero_rows
        else:
            pos = idx * M_RATIO
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=kl, other=0).to(tl.int64)
            slot = (pos % BLOCK_SIZE) // M_RATIO
            page = pages_ptr + blk * PAGE_BYTES
        if FORMAT == 0:
            xb = tl.load(page[:, None, None] + (slot * 64)[:, None, None] + (tl.arange(0, 4) * 16)[None, :, None]
                         + tl.arange(0, 16)[None, None, :], mask=kl[:, None, None], other=0)  # [BLOCK_N, 4, 16]
            if PAGE_VECTOR:
                e = e_next
                nt = tile + 1
                blk_n = tl.sum(tl.where(tiles == it + 1, tile_pages, 0)).to(tl.int64)
                e_next = _mxfp4_scales(pages_ptr + blk_n * PAGE_BYTES + zero_rows, (nt * BLOCK_N) % ENTRIES + rows,
                                       (nt * BLOCK_N + rows < n_keys) & (nt < tile_hi), ENTRIES)
            else:
                e = _mxfp4_scales(page, slot, kl, ENTRIES)
            e_max = tl.max(e, axis=1)
            t_lo, t_hi = block_lookup_tables(e, e_max)
            if USE_ASM:
                klo, khi = unpack_keys_asm(xb, t_lo[:, :, None], t_hi[:, :, None])
            else:
                klo, khi = unpack_keys_int(xb, t_lo[:, :, None], t_hi[:, :, None], BLOCK_N)
            ka = tl.reshape(klo, (BLOCK_N, 64)).to(tl.float8e4nv, bitcast=True)
            kb = tl.reshape(khi, (BLOCK_N, 64)).to(tl.float8e4nv, bitcast=True)
            ks = pow2_from_byte(e_max - 6)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, False)
        elif FORMAT == 1:
            # values: ENTRIES * 128 E4M3 bytes, then ENTRIES fp32 scales
            krow = page[:, None] + slot[:, None] * 128 + half[None, :]
            ka = tl.load(krow, mask=kl[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            kb = tl.load(krow + 64, mask=kl[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            ks = tl.load((page + ENTRIES * 128 + slot * 4).to(tl.pointer_type(tl.float32)), mask=kl, other=0.0)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, False)
        else:
            krow = (page + slot * 512).to(tl.pointer_type(tl.float32))[:, None] + half[None, :]
            ka = tl.load(krow, mask=kl[:, None], other=0.0)
            kb = tl.load(krow + 64, mask=kl[:, None], other=0.0)
            ks = tl.full((BLOCK_N,), 1.0, tl.float32)
            sc = _head_sum(ka, kb, qa, qb, w_half, BLOCK_N, QT, HP, True)
        # relu, head weights (query scale folded in) and the head sum are done; the key scale
        sc = sc * ks[:, None]  # [BLOCK_N, QT]
        dst = (t0 + tl.arange(0, QT))[None, :].to(tl.int64) * out_stride + idx[:, None]
        if USE_ASM:
            _store_scores(out_ptr, dst, sc, idx[:, None] < vis_q[None, :])
        else:
            tl.store(out_ptr + dst, sc.to(out_ptr.dtype.element_ty), mask=idx[:, None] < vis_q[None, :])


#: Most key tiles one program of the scores kernel takes when its pages are held in registers (``PAGE_VECTOR``).
MAX_TILES_PER_SPLIT = 32


def pick_scores_config(fmt: int, head_pad: int, max_new: int) -> dict:
    """Launch parameters of the scores kernel: ``QT`` queries per program (keys read once for all of them),
    ``BLOCK_N`` keys per tile, warps and pipeline depth."""
    qt = 1
    while qt < max_new and qt * 2 * head_pad <= 256:
        qt *= 2
    if fmt == FMT_FP32:
        return dict(QT=max(1, min(qt, 128 // head_pad)), BLOCK_N=64, num_warps=4, NUM_STAGES=2)
    if qt * head_pad >= 256:
        return dict(QT=qt, BLOCK_N=128, num_warps=8, NUM_STAGES=3)
    # 3 stages: a tile's keys are read two tiles ahead (with 2 the copy is issued after a tile's compute and
    # awaited before the next one's, with nothing in between)
    return dict(QT=qt, BLOCK_N=64, num_warps=4, NUM_STAGES=3)


def index_scores(
    pages: Tensor,
    block_tables: Tensor,
    cu_seqlens: Tensor,
    visible: Tensor,
    q: Tensor,
    w: Tensor,
    out: Tensor,
    *,
    fmt: int,
    m: int,
    block_size: int,
    entries_per_page: int,
    num_requests: int,
    max_new: int,
    max_entries: int,
    num_sms: int | None = None,
    config: dict | None = None,
) -> Tensor:
    """Index scores of every query against its request's visible keys, read from the paged pool.

    Args:
        pages: uint8 ``[num_blocks, page_bytes]`` indexer key pages (format ``fmt``).
        block_tables: int32 ``[B, max_blocks]``; cu_seqlens: int32 ``[B + 1]``; visible: int64 ``[T]``.
        q: ``[T, 2, HP, 64]`` query operand (uint8 E4M3 bytes for MXFP4 / FP8, float32 for FP32).
        w: float32 ``[T, HP]`` head weights times the query scales (0 on padded heads).
        out: ``[T, >= max_entries]`` score buffer (BF16 or FP32); row ``t`` is written for ``s < visible[t]``
            only, other elements are left as they were.
        m, block_size, entries_per_page: the layer's ratio and pool geometry.
        num_requests, max_new, max_entries: host facts of the step (grid sizing; no device sync).
        num_sms: multiprocessors to fill (default: the current device's).
        config: override of ``pick_scores_config`` (keys ``QT``, ``BLOCK_N``, ``num_warps``, ``NUM_STAGES``,
            ``PROGRAMS_PER_SM``, ``USE_ASM``, ``PAGE_VECTOR``: a split's block-table entries held in registers, the
            default where tiles lie within a page; ``maxnreg``: a register cap per thread (the Gluon kernel's
            default ``scores_sm90.register_cap``, 0 for none); ``GLUON``: ``False`` keeps the Triton kernel
            where the Gluon one (``indexer_sm90``) would serve: MXFP4 keys on sm_90; ``GLUON_QT``: its queries per
            program for multi-token steps, default ``scores_sm90.CHUNK_QUERIES``; ``MIN_TILES_PER_PROGRAM``: its
            shortest split, default 8).
    Returns:
        ``out``.
    """
    T = q.shape[0]
    if T == 0 or max_entries == 0 or num_requests == 0:
        return out
    HP = q.shape[2]
    cfg = dict(pick_scores_config(fmt, HP, max_new))
    if config:
        cfg.update(config)
    use_gluon = (fmt == FMT_MXFP4 and cfg.get("GLUON", True) and not interpreting()
                 and scores_sm90.applies(HP, entries_per_page) and scores_sm90.available(q.device))
    if use_gluon:
        QT, BLOCK_N = scores_sm90.queries_per_program(max_new, HP, cfg.get("GLUON_QT")), scores_sm90.BLOCK_N
    else:
        QT, BLOCK_N = cfg["QT"], cfg["BLOCK_N"]
    page_vector = cfg.get("PAGE_VECTOR", entries_per_page % BLOCK_N == 0)
    if page_vector and entries_per_page % BLOCK_N:
        raise ValueError(f"PAGE_VECTOR needs tiles within a page: BLOCK_N={BLOCK_N} must divide the "
                         f"{entries_per_page} entries per page")
    chunks = triton.cdiv(max_new, QT)
    tiles = triton.cdiv(max_entries, BLOCK_N)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    # many short programs: the last wave's tail stays small
    splits = max(1, min(tiles, triton.cdiv(cfg.get("PROGRAMS_PER_SM", 16) * num_sms, num_requests * chunks)))
    if use_gluon:  # but not so short that the pipeline's fill dominates (small batches)
        splits = min(splits, triton.cdiv(tiles, cfg.get("MIN_TILES_PER_PROGRAM", scores_sm90.MIN_TILES_PER_PROGRAM)))
    per_split = triton.cdiv(tiles, splits)
    if page_vector and not use_gluon:  # a split's pages are held in registers: at most MAX_TILES_PER_SPLIT
        per_split = min(per_split, MAX_TILES_PER_SPLIT)
    splits = triton.cdiv(tiles, per_split)
    if use_gluon:
        scores_sm90.launch(pages, block_tables, cu_seqlens, visible, q, w, out, entries_per_page=entries_per_page,
                            num_requests=num_requests, queries=QT, chunks=chunks, tiles_per_split=per_split,
                            splits=splits, maxnreg=cfg.get("maxnreg"))
        return out
    grid = (splits, chunks, num_requests)
    _scores_kernel[grid](
        pages, block_tables, block_tables.stride(0), cu_seqlens, visible, q, w, out, out.stride(0),
        pages.stride(0), per_split,
        M_RATIO=m, BLOCK_SIZE=block_size, ENTRIES=entries_per_page, HP=HP, QT=QT, BLOCK_N=BLOCK_N,
        FORMAT=fmt, USE_ASM=cfg.get("USE_ASM", not interpreting()), NUM_STAGES=cfg["NUM_STAGES"],
        PAGE_VECTOR=page_vector, MAX_TPS=MAX_TILES_PER_SPLIT,
        HOST_BOUND=interpreting(),
        TPS_HINT=per_split if interpreting() else 0,
        num_warps=cfg["num_warps"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )
    return out

