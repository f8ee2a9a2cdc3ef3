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

import triton
import triton.language as tl
from torch import Tensor

from ..device import interpreting
from . import scores_sm90
from .fp8_operands import block_lookup_tables, pow2_from_byte, unpack_keys_asm, unpack_keys_int
from .scores_plan import MAX_TILES_PER_SPLIT, ScoresPlan, sm90_applies

__all__ = ["FMT_FP8", "FMT_FP32", "FMT_MXFP4", "FORMAT_CODES", "index_scores"]

FMT_MXFP4 = 0
FMT_FP8 = 1
FMT_FP32 = 2


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


FORMAT_CODES = {"mxfp4": FMT_MXFP4, "fp8": FMT_FP8, "fp32": FMT_FP32}


def index_scores(pages: Tensor, block_tables: Tensor, cu_seqlens: Tensor, visible: Tensor, q: Tensor, w: Tensor,
                 out: Tensor, plan: ScoresPlan) -> Tensor:
    """Index scores of every query against its request's visible keys, read from the paged pool, by the kernel and
    grid of ``plan`` (``scores_plan.plan_scores``).

    Args:
        pages: uint8 ``[num_blocks, page_bytes]`` indexer key pages (format ``plan.key_format``).
        block_tables: int32 ``[B, max_blocks]``; cu_seqlens: int32 ``[B + 1]``; visible: int64 ``[T]``.
        q: ``[T, 2, HP, 64]`` query operand (uint8 E4M3 bytes for MXFP4 / FP8, float32 for FP32;
            ``HP = plan.head_pad``).
        w: float32 ``[T, HP]`` head weights times the query scales (0 on padded heads).
        out: ``[T, >= plan.entries]`` score buffer (BF16 or FP32); row ``t`` is written for ``s < visible[t]``
            only, other elements are left as they were.
        plan: the step's scores plan.
    Returns:
        ``out``.
    Raises:
        ValueError: inputs or a device that do not match the plan.
    """
    if not plan.launches:
        return out
    _check(plan, q, out)
    if plan.kernel == "sm90":
        scores_sm90.launch(pages, block_tables, cu_seqlens, visible, q, w, out, plan)
        return out
    _scores_kernel[plan.grid](
        pages, block_tables, block_tables.stride(0), cu_seqlens, visible, q, w, out, out.stride(0),
        pages.stride(0), plan.tiles_per_split,
        M_RATIO=plan.ratio, BLOCK_SIZE=plan.block_size, ENTRIES=plan.entries_per_page, HP=plan.head_pad,
        QT=plan.queries_per_program, BLOCK_N=plan.block_n, FORMAT=FORMAT_CODES[plan.key_format],
        USE_ASM=plan.inline_ptx, NUM_STAGES=plan.num_stages, PAGE_VECTOR=plan.page_vector, MAX_TPS=MAX_TILES_PER_SPLIT,
        HOST_BOUND=plan.interpreted, TPS_HINT=plan.tiles_per_split if plan.interpreted else 0,
        num_warps=plan.num_warps, **({"maxnreg": plan.max_registers} if plan.max_registers else {}),
    )
    return out


def _check(plan: ScoresPlan, q: Tensor, out: Tensor) -> None:
    """Raise unless ``q`` / ``out`` and the device are what ``plan`` was made for (cheap host checks)."""
    if plan.interpreted != interpreting():
        raise ValueError(f"index_scores: a plan for {'the interpreter' if plan.interpreted else 'a GPU'} cannot run "
                         f"{'in the interpreter' if interpreting() else 'on a GPU'}")
    if plan.inline_ptx and plan.interpreted:
        raise ValueError("index_scores: the interpreter runs no inline PTX (plan with inline_ptx and interpreted)")
    if q.shape[2] != plan.head_pad:
        raise ValueError(f"index_scores: the queries have {q.shape[2]} padded heads, the plan {plan.head_pad}")
    if out.shape[1] < plan.entries:
        raise ValueError(f"index_scores: the score buffer has {out.shape[1]} columns, the plan {plan.entries}")
    if plan.kernel == "sm90":
        if plan.key_format != "mxfp4" or not sm90_applies(plan.head_pad, plan.entries_per_page):
            raise ValueError(f"index_scores: the Gluon kernel takes MXFP4 keys, 16-256 padded heads and pages of a "
                             f"multiple of {plan.block_n} entries, not this plan's")
    elif plan.page_vector and (plan.entries_per_page % plan.block_n or plan.tiles_per_split > MAX_TILES_PER_SPLIT):
        raise ValueError(f"index_scores: pages held in registers need tiles within a page (block_n={plan.block_n}, "
                         f"{plan.entries_per_page} entries per page) and at most {MAX_TILES_PER_SPLIT} tiles per "
                         f"program (plan: {plan.tiles_per_split})")
