"""Running one step's sparse attention: ``sparse_attention_fwd`` plans it (or takes a plan) and launches it.

The order of a step: ``plan_for`` (the plan from the tensors' shapes and the device: ``plan.plan_attention``) →
``AttentionArgs.build`` (the kernels' shared arguments, the split partials) → ``bf16_keys`` where the plan reads
BF16 key rows → the plan's kernel (``triton_kernel``, ``sm90_serial``, ``sm90_ws``, ``sm90_pipelined``) → the
combine kernel where the plan merges splits with it (``combine``). A plan given to ``sparse_attention_fwd`` is
checked against the tensors (cheap checks that raise); ``run`` only consumes it and re-decides nothing.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..device import KV_DIM, is_sm90, sm_count
from . import combine, sm90_pipelined, sm90_serial, sm90_ws, triton_kernel
from .args import AttentionArgs, rows_are_words
from .bf16_keys import bf16_keys
from .plan import AttentionPlan, plan_attention

__all__ = ["plan_for", "run", "sparse_attention_fwd"]


def _entry_source(entry_idx: Tensor | None, visible: Tensor | None, max_entries: int) -> tuple[str, int]:
    """``(mode, num_compressed)`` of a step's compressed entries: ``entry_idx`` lists (their width), ``visible``
    counts (bound ``max_entries``) or none; no entries at all is ``"window"``."""
    if entry_idx is not None and entry_idx.shape[1]:
        return "list", entry_idx.shape[1]
    if entry_idx is None and visible is not None and max_entries:
        return "all", int(max_entries)
    return "window", 0


def plan_for(q: Tensor, kv_new: Tensor, block_tables: Tensor, *, window: int, ratio: int = 0, block_size: int = 1,
             entry_idx: Tensor | None = None, visible: Tensor | None = None, max_entries: int = 0,
             max_visible: int | None = None, **requests) -> AttentionPlan:
    """The plan of ``sparse_attention_fwd`` for these tensors (its arguments, see there) on their device:
    ``plan.plan_attention`` with the shapes, whether the rows are 16-byte words, the device's multiprocessors and
    — on Hopper — its resident clusters; ``requests``: ``impl``, ``keys``, ``combine``, ``num_splits`` and the
    Triton tiling (``block_h``, ``block_n``, ``num_warps``, ``num_stages``).

    Raises:
        ValueError: as ``plan_attention``, with the device and the q / kv_new strides named.
    """
    mode, num_compressed = _entry_source(entry_idx, visible, max_entries)
    sm90 = is_sm90(q.device)
    clusters = None
    if sm90:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        clusters = functools.partial(sm90_serial.resident_clusters, index)
    try:
        return plan_attention(
            tokens=q.shape[0], requests=block_tables.shape[0], heads=q.shape[1], window=window, ratio=ratio,
            block_size=block_size, mode=mode, num_compressed=num_compressed,
            max_visible=max_visible, sm_count=sm_count(q.device), sm90=sm90, rows_in_words=rows_are_words(q, kv_new),
            resident_clusters=clusters, **requests)
    except ValueError as err:
        raise ValueError(f"{err} (device {q.device}, q strides {tuple(q.stride())}, kv_new strides "
                         f"{tuple(kv_new.stride())})") from None


def _check(plan: AttentionPlan, q: Tensor, kv_new: Tensor, pool: Tensor | None, block_tables: Tensor,
           entries: tuple[str, int], window: int, ratio: int, block_size: int) -> None:
    """Raise ``ValueError`` where ``plan`` was made for other tensors than these (``entries``: their
    ``_entry_source``)."""
    made_for = (plan.tokens, plan.heads, plan.requests, plan.window, plan.ratio, plan.block_size,
                plan.mode, plan.num_compressed)
    given = (*q.shape[:2], block_tables.shape[0], window, ratio, block_size, *entries)
    if made_for != given:
        raise ValueError(f"the plan is for (tokens, heads, requests, window, ratio, block size, mode, compressed "
                         f"entries) {made_for}, the step has {given}")
    if plan.mode != "window" and pool is None:
        raise ValueError("compressed entries need the pool pages")
    if plan.kernel != "triton" and not is_sm90(q.device):
        raise ValueError(f"kernel {plan.kernel!r} needs a CUDA device of compute capability 9.x (device {q.device})")
    if plan.kernel in ("gluon_ws", "gluon_pipelined") and not rows_are_words(q, kv_new):
        raise ValueError(f"kernel {plan.kernel!r} reads q and kv_new rows as 16-byte words: their strides must be "
                         f"multiples of 8 and their data 16-byte aligned (q strides {tuple(q.stride())})")


def run(plan: AttentionPlan, args: AttentionArgs, key_rows: Tensor | None) -> None:
    """Launch the kernels of ``plan`` over ``args`` (``key_rows``: the step's BF16 key rows where ``plan.keys`` is
    ``"bf16"``)."""
    if plan.kernel == "triton":
        triton_kernel.launch(plan, args)
    elif plan.kernel == "gluon":
        sm90_serial.launch(plan, args, key_rows)
    elif plan.kernel == "gluon_ws":
        sm90_ws.launch(plan, args)
    else:
        sm90_pipelined.launch(plan, args, key_rows)
    if plan.merge == "combine_kernel":
        combine.launch(plan, args)


def sparse_attention_fwd(
    q: Tensor,
    kv_new: Tensor,
    ring: Tensor,
    ring_positions: Tensor,
    pool: Tensor | None,
    block_tables: Tensor,
    token_request: Tensor,
    positions: Tensor,
    cu_seqlens: Tensor,
    start_pos: Tensor,
    token_slots: Tensor,
    sink: Tensor,
    inv_freq: Tensor,
    scale: float,
    *,
    window: int,
    ratio: int = 0,
    block_size: int = 1,
    entry_idx: Tensor | None = None,
    visible: Tensor | None = None,
    max_entries: int = 0,
    max_visible: int | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    workspace=None,
    plan: AttentionPlan | None = None,
    **requests,
) -> tuple[Tensor, Tensor]:
    """Attention of ``T`` query tokens over their window and compressed entries, sink, inverse RoPE.

    Args:
        q: ``[T, H, 512]`` bf16 queries (head-normed, RoPE'd).
        kv_new: ``[T, 512]`` bf16 this step's window entries as stored.
        ring: uint8 ``[slots, ring_page_bytes]`` SWA ring pages (``window`` entries of 584 B each).
        ring_positions: int32 ``[slots, window]`` position held by each ring slot (−1 = empty).
        pool: uint8 ``[num_blocks, page_bytes]`` compressed-entry pages (``block_size // ratio`` entries), or
            ``None`` for window-only layers.
        block_tables: int32 ``[B, max_blocks]`` physical block of each logical block (−1 = none).
        token_request / positions / cu_seqlens / start_pos / token_slots: the ``StepBatch`` fields
            (int32 ``[T]``, int64 ``[T]``, int32 ``[B+1]``, int64 ``[B]``, int64 ``[T]``).
        sink: fp32 ``[H]`` sink logits; inv_freq: fp32 ``[32]`` RoPE frequencies; scale: softmax scale.
        window, ratio, block_size: the layer's geometry (``ratio`` 0: window only).
        entry_idx: int ``[T, K]`` entries to attend (CSA), −1 = none; or
        visible: int64 ``[T]`` entries visible to each token (HCA: attend all ``i < visible[t]``) with
            ``max_entries`` ≥ every ``visible[t]`` (a host bound).
        max_visible: a host bound on the compressed entries any token of the step sees (with ``entry_idx``: lets
            the plan read BF16 key rows).
        out / lse: optional outputs ``[T, H, 512]`` (dtype of ``q``) / fp32 ``[T, H]``.
        workspace: a ``dsv4.cache.Workspace`` for the split partials and BF16 key rows (else allocated).
        plan: the step's ``AttentionPlan`` (else ``plan_for`` makes one from the tensors and ``requests``).
        requests: ``plan_attention``'s ``impl`` (``"auto"``, ``"triton"``, ``"gluon"``, ``"gluon_ws"``,
            ``"gluon_pipelined"``), ``keys`` (``"auto"``, ``"fp8"``, ``"bf16"``), ``combine`` (``"auto"``,
            ``"kernel"``, ``"cluster"``), ``num_splits`` and the Triton tiling; only without ``plan``.
    Returns:
        ``(o [T, H, 512], lse fp32 [T, H])``: ``o`` with the inverse RoPE applied, ``lse`` with the sink.
    Raises:
        ValueError: a request that cannot run on this device / these tensors, or a plan made for others.
    """
    T, H, D = q.shape
    if D != KV_DIM:
        raise ValueError(f"sparse_attention_fwd supports head_dim {KV_DIM}, got {D}")
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if plan is None:
        plan = plan_for(q, kv_new, block_tables, window=window, ratio=ratio, block_size=block_size,
                        entry_idx=entry_idx, visible=visible, max_entries=max_entries, max_visible=max_visible,
                        **requests)
    elif requests:
        raise ValueError(f"pass a plan or requests, not both (requests {sorted(requests)})")
    _check(plan, q, kv_new, pool, block_tables, _entry_source(entry_idx, visible, max_entries), window, ratio,
           block_size)
    args = AttentionArgs.build(plan, q, kv_new, ring, ring_positions, pool, block_tables, token_request, positions,
                               cu_seqlens, start_pos, token_slots, sink, inv_freq, scale, entry_idx, visible, out,
                               lse, workspace)
    key_rows = None
    if plan.keys == "bf16":
        key_rows = bf16_keys(ring, pool, block_tables, cu_seqlens, start_pos, token_slots, window=window,
                             ratio=ratio, block_size=block_size, entries=plan.key_entries, workspace=workspace)
    run(plan, args, key_rows)
    return out, lse
