"""The output of the Hopper attention kernels, and the merge of a token's splits run as one cluster.

``_write_output`` (serial and warp-specialized kernels): with splits the program's FP32 partial (``o/l`` and its
log-sum-exp, base 2) — and, in a cluster of the token's splits, this program's share of their merge once every
split has written (``_cluster_combine``: the combine kernel's formula, one pass with a running max) —; without, the
sink applied, the BF16 output staged through the free query tiles for 16-byte stores, and the rope dims rotated
back by −pos (``_unrotation``, ``_store_rope``; rounded to BF16 before and after, as the reference).
"""

from __future__ import annotations

from .sm90_common import _HAVE_GLUON

if _HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .sm90_common import BH, NOPE_DIM, NW, Q_L, _rescale

    @gluon.jit
    def _store_group(o, inv, dst_ptr, row_off, head_ok, FIRST: gl.constexpr):
        """``o · inv`` (``[64, W]`` fp32 accumulator of dims ``64·FIRST …``, ``inv`` per head) at ``dst_ptr +
        row_off[h] + 64·FIRST + i`` in ``dst_ptr``'s dtype."""
        L: gl.constexpr = o.type.layout
        rows = gl.convert_layout(row_off, gl.SliceLayout(1, L))
        ok = gl.convert_layout(head_ok, gl.SliceLayout(1, L))
        cols = FIRST * 64 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, L))
        val = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, L)), 1)
        gl.store(dst_ptr + gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), val.to(dst_ptr.dtype.element_ty),
                 mask=gl.expand_dims(ok, 1))

    @gluon.jit
    def _store_tile(tile, dst_ptr, stride_oh, hb, H, FIRST: gl.constexpr):
        """Store the BF16 tile ``tile`` ``[64 heads, W]`` (shared memory) at ``dst_ptr + h·stride_oh + 64·FIRST + i``
        with 16-byte stores (heads ``≥ H`` skipped)."""
        heads = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Q_L))
        cols = FIRST * 64 + gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, Q_L))
        ptrs = dst_ptr + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, tile.load(Q_L), mask=gl.expand_dims(heads < H, 1))

    @gluon.jit
    def _write_output(o0, o1, o2, o3, m_i, l_i, q0, q1, q2, heads, t, hb, H, pos, split, num_splits, sink_ptr,
                      inv_freq_ptr, o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, po_ptr, plse_ptr,
                      SPLIT: gl.constexpr, CLUSTER: gl.constexpr):
        """The program's result from its accumulators (``o0 … o3`` FP32 ``[64, dims]``, running max ``m_i`` and sum
        ``l_i`` per head, base 2; ``heads`` int ``[64]``): with ``SPLIT`` the partial o/l and its log-sum-exp (an
        empty split: lse −inf, o 0) — then, in a cluster of the token's splits (``CLUSTER`` > 1), this program's
        share of the merge (``_cluster_combine``) once every split's partial is written —, else the sink
        applied, the BF16 output staged through the query tiles ``q0 … q2`` (free once the last S = Q·Kᵀ is
        done) for 16-byte stores, the rope dims rotated back, and the lse."""
        HL: gl.constexpr = heads.type.layout
        head_ok = heads < H
        if SPLIT:
            has = l_i > 0
            inv = 1.0 / gl.where(has, l_i, 1.0)
            plse = gl.where(has, gl.where(m_i == float("-inf"), 0.0, m_i) + gl.log2(gl.where(has, l_i, 1.0)),
                            float("-inf"))
            row = (t * num_splits + split) * H + heads
            _store_group(o0, inv, po_ptr, row * 512, head_ok, 0)
            _store_group(o1, inv, po_ptr, row * 512, head_ok, 4)
            _store_group(o2, inv, po_ptr, row * 512, head_ok, 6)
            _store_group(o3, inv, po_ptr, row * 512, head_ok, 7)
            gl.store(plse_ptr + row, gl.convert_layout(plse, HL), mask=head_ok)
            if CLUSTER > 1:
                cos, sin = _unrotation(pos, inv_freq_ptr)  # requested before the wait
                _cluster_barrier()
                _cluster_combine(po_ptr, plse_ptr, t, hb, H, split, num_splits, cos, sin, sink_ptr, o_ptr,
                                 stride_ot, stride_oh, lse_ptr, stride_lt, CLUSTER)
        else:
            sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
            m_use = gl.convert_layout(gl.where(m_i == float("-inf"), 0.0, m_i), HL)
            denom = gl.convert_layout(l_i, HL) + gl.exp2(sink - m_use)
            gl.store(lse_ptr + t * stride_lt + heads, (m_use + gl.log2(denom)) * 0.6931471805599453, mask=head_ok)
            inv = 1.0 / denom
            q0.store(_rescale(o0, inv).to(gl.bfloat16))
            q1.store(_rescale(o1, inv).to(gl.bfloat16))
            q2.store(_rescale(o2, inv).to(gl.bfloat16))
            gl.thread_barrier()
            _store_tile(q0, o_ptr + t * stride_ot, stride_oh, hb, H, 0)
            _store_tile(q1, o_ptr + t * stride_ot, stride_oh, hb, H, 4)
            _store_tile(q2, o_ptr + t * stride_ot, stride_oh, hb, H, 6)
            # The rope dims: rounded to BF16, rotated back by −pos, rounded again (as the reference).
            cos, sin = _unrotation(pos, inv_freq_ptr)
            _store_rope(_rescale(o3, inv).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, hb * BH, H,
                        cos, sin)

    @gluon.jit
    def _unrotation(pos, inv_freq_ptr, NWARPS: gl.constexpr = NW):
        """``(cos, −sin)`` of ``pos·ω_i`` per rope pair ``i``, fp32 ``[1, 32]`` in ``_store_rope``'s layout of
        ``[heads, 32 pairs, 2]`` over ``NWARPS`` warps."""
        PL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [NWARPS, 1, 1], [2, 1, 0])
        pair = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        angle = pos.to(gl.float32) * gl.load(inv_freq_ptr + pair)
        return (gl.expand_dims(gl.extra.libdevice.cos(angle), 0),
                gl.expand_dims(-gl.extra.libdevice.sin(angle), 0))

    @gluon.jit
    def _store_rope(o3, rope_ptr, stride_oh, head0, head_end, cos, sin):
        """Store the rope dims of heads ``head0 …`` (``o3`` BF16 ``[rows, 64]``, any layout) at ``rope_ptr +
        h·stride_oh + i``, rotated back per adjacent pair (``cos`` / ``sin`` of ``−pos·ω_i``: ``_unrotation``) in
        FP32 and rounded to BF16 again; heads from ``head_end`` on are not stored."""
        ROWS: gl.constexpr = o3.shape[0]
        PL: gl.constexpr = cos.type.layout.parent
        ROW2_L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [PL.warps_per_cta[0], 1], [1, 0])
        pairs = gl.convert_layout(gl.reshape(gl.convert_layout(o3, ROW2_L), [ROWS, 32, 2]), PL)
        re, im = gl.split(pairs.to(gl.float32))
        heads = head0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, PL)))
        pair = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL)))
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, PL)))
        out = gl.join(re * cos - im * sin, re * sin + im * cos)
        ptrs = rope_ptr + heads[:, None, None] * stride_oh + (2 * pair)[None, :, None] + half[None, None, :]
        mask = (heads < head_end)[:, None, None] & (half >= 0)[None, None, :]
        gl.store(ptrs, out.to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _cluster_barrier():
        """Every thread of the cluster waits here for every other (``barrier.cluster``, arrive with release and
        wait with acquire semantics: the global writes each CTA made before it are visible to all after it)."""
        ONE_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])  # one element per thread
        token = gl.zeros([32 * NW], gl.int32, ONE_L)
        gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.b32 $0, $1;",
            "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _cluster_combine(po_ptr, plse_ptr, t, hb, H, rank, num_splits, cos, sin, sink_ptr, o_ptr, stride_ot,
                         stride_oh, lse_ptr, stride_lt, CLUSTER: gl.constexpr):
        """Program ``rank`` of a cluster holding token ``t``'s ``CLUSTER`` splits (head block ``hb``) merges its
        share of the 64 heads — ``ceil(64 / CLUSTER)`` of them, 8 at a time — from every split's partial row
        (``po_ptr`` fp32 ``[T, S, H, 512]``, log-sum-exp ``plse_ptr`` ``[T, S, H]``, base 2) as
        ``combine._combine_kernel`` does: ``o = Σ_s 2^{lse_s − M} o_s / (Σ_s 2^{lse_s − M} + 2^{sink −
        M})`` with ``M`` the largest of the ``lse_s`` and the sink, the BF16 output with its rope dims rotated back
        (``cos`` / ``sin``: ``_unrotation``), and the lse (natural log)."""
        HPC: gl.constexpr = (BH + CLUSTER - 1) // CLUSTER
        C_L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])  # [8 heads, 512 dims]
        R_L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NW, 1], [1, 0])  # [8 heads, 64 rope dims]
        d = gl.arange(0, 512, layout=gl.SliceLayout(0, C_L))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, R_L))
        head_end = gl.minimum(H, hb * BH + gl.minimum((rank + 1) * HPC, BH))
        for g in gl.static_range((HPC + 7) // 8):
            head0 = hb * BH + rank * HPC + g * 8
            heads = head0 + gl.arange(0, 8, layout=gl.SliceLayout(1, C_L))
            ok = heads < head_end
            heads_r = head0 + gl.arange(0, 8, layout=gl.SliceLayout(1, R_L))
            ok_r = heads_r < head_end
            # One pass with a running max (the sums so far rescaled when it grows), so that no load waits for
            # another: every split's rows are requested at once.
            m = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, C_L))
            nope = gl.zeros([8, 512], gl.float32, layout=C_L)
            rope = gl.zeros([8, 64], gl.float32, layout=R_L)
            weight = gl.zeros([8], gl.float32, layout=gl.SliceLayout(1, C_L))
            for s in gl.static_range(CLUSTER):
                row = (t * num_splits + s) * H + heads
                plse = gl.load(plse_ptr + row, mask=ok, other=float("-inf"))
                po = gl.load(po_ptr + gl.expand_dims(row * 512, 1) + gl.expand_dims(d, 0),
                             mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < NOPE_DIM, 0), other=0.0)
                row_r = (t * num_splits + s) * H + heads_r
                po_r = gl.load(po_ptr + gl.expand_dims(row_r * 512 + NOPE_DIM, 1) + gl.expand_dims(r, 0),
                               mask=gl.expand_dims(ok_r, 1), other=0.0)
                m_new = gl.maximum(m, plse)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # 0 while no split has a key
                grown = gl.exp2(m - m_use)  # ≤ 1; 0 before the first split with a key
                w = gl.exp2(plse - m_use)  # 0 where absent
                nope = nope * gl.expand_dims(grown, 1) + gl.expand_dims(w, 1) * po
                grown_r = gl.expand_dims(gl.convert_layout(grown, gl.SliceLayout(1, R_L)), 1)
                rope = rope * grown_r + gl.expand_dims(gl.convert_layout(w, gl.SliceLayout(1, R_L)), 1) * po_r
                weight = weight * grown + w
                m = m_new
            sink = gl.load(sink_ptr + heads, mask=ok, other=0.0) * 1.4426950408889634
            top = gl.maximum(m, sink)
            kept = gl.exp2(m - top)  # 1 where m ≥ sink; 0 where no split has a key
            denom = weight * kept + gl.exp2(sink - top)
            gl.store(lse_ptr + t * stride_lt + heads, (top + gl.log2(denom)) * 0.6931471805599453, mask=ok)
            scaled = denom / kept  # inf where no split has a key: o = 0
            out = o_ptr + t * stride_ot + gl.expand_dims(heads * stride_oh, 1) + gl.expand_dims(d, 0)
            gl.store(out, (nope / gl.expand_dims(scaled, 1)).to(o_ptr.dtype.element_ty),
                     mask=gl.expand_dims(ok, 1) & gl.expand_dims(d < NOPE_DIM, 0))
            scaled_r = gl.expand_dims(gl.convert_layout(scaled, gl.SliceLayout(1, R_L)), 1)
            _store_rope((rope / scaled_r).to(gl.bfloat16), o_ptr + t * stride_ot + NOPE_DIM, stride_oh, head0,
                        head_end, cos, sin)
