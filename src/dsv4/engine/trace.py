"""Tracing for the spot check (``dsv4.engine.check``): a traced request's per-layer inputs and outputs, recorded
as its tokens run (``Engine.trace`` names the requests and layers before a run)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..cache.batch import StepBatch
from ..config import LayerKind, ModelConfig
from .requests import Request

__all__ = ["Trace", "alloc_traces", "fill_prefix_traces", "record_traces", "trace_layers"]


@dataclass
class Trace:
    """A traced request's per-layer inputs and outputs, filled as its tokens run (positions ``0 … L−1``).

    A request that started from a cached prefix of P tokens never ran them: its rows ``0 … P−1`` are copied from
    a traced request that computed the same prefix (``prefix_from``; the same token ids give the same inputs and
    outputs there), else ``missing`` = P and the spot check refuses it.

    Attributes:
        x: ``{layer: [L, d]}`` act dtype, the layer's input (``rms_norm`` of the residual).
        y: ``{layer: [L, d]}`` act dtype, the layer's output.
        entry_idx: ``{layer: [L, K]}`` int64 compressed entries attended (CSA layers only; −1 padded).
        filled: tokens recorded so far.
        prefix_from: the traced request whose rows ``0 … P−1`` were copied.
        missing: leading rows no traced request computed (0: complete).
    """

    request_id: str
    length: int
    x: dict[int, Tensor] = field(default_factory=dict)
    y: dict[int, Tensor] = field(default_factory=dict)
    entry_idx: dict[int, Tensor] = field(default_factory=dict)
    filled: int = 0
    prefix_from: str | None = None
    missing: int = 0


def trace_layers(layers: Iterable[int] | None, layer_ids: Sequence[int]) -> list[int]:
    """The layers to trace: ``layers`` (default: all of ``layer_ids``); ``ValueError`` for one not in the stack."""
    out = list(layer_ids if layers is None else layers)
    bad = [li for li in out if li not in layer_ids]
    if bad:
        raise ValueError(f"cannot trace layers {bad}: not in the engine's stack {list(layer_ids)}")
    return out


def alloc_traces(
    traces: Mapping[str, Trace], layers: Sequence[int], requests: Mapping[str, Request], cfg: ModelConfig,
    act: torch.dtype, device: torch.device,
) -> None:
    """Size every trace for its request's whole length (``x`` / ``y`` zeros in ``act``, ``entry_idx`` −1 on CSA
    layers) on ``device``; ``ValueError`` for a traced request that was not submitted."""
    for rid, tr in traces.items():
        if rid not in requests:
            raise ValueError(f"traced request {rid!r} was not submitted")
        L = requests[rid].total_len
        tr.length = L
        for li in layers:
            tr.x[li] = torch.zeros(L, cfg.hidden_size, dtype=act, device=device)
            tr.y[li] = torch.zeros(L, cfg.hidden_size, dtype=act, device=device)
            if cfg.layer_kind(li) is LayerKind.CSA:
                tr.entry_idx[li] = torch.full((L, cfg.index_topk), -1, dtype=torch.int64, device=device)


def record_traces(
    traces: Mapping[str, Trace], batch: StepBatch, kept: Mapping[int, tuple[Tensor, Tensor, Tensor]]
) -> None:
    """Copy one step's kept ``(x [T, d], y [T, d], entry_idx [T, K])`` per layer into the traces of the batch's
    traced requests, at their positions (device copies, no host sync)."""
    if not traces:
        return
    offset = 0
    for rid, start, n in zip(batch.request_ids, batch.start_positions, batch.num_new):
        tr = traces.get(rid)
        if tr is not None:
            for li, (x, y, idx) in kept.items():
                tr.x[li][start : start + n] = x[offset : offset + n]
                tr.y[li][start : start + n] = y[offset : offset + n]
                if li in tr.entry_idx:
                    dst = tr.entry_idx[li]
                    k = min(dst.shape[1], idx.shape[1])
                    dst[start : start + n, :k] = idx[offset : offset + n, :k]
            tr.filled = max(tr.filled, start + n)
        offset += n


def fill_prefix_traces(
    traces: Mapping[str, Trace], requests: Sequence[Request], token_ids: Mapping[str, Tensor]
) -> None:
    """Traced requests that started from a cached prefix: copy their rows ``0 … P−1`` from a traced request
    with the same first P token ids (``token_ids``: request id → int64 ``[total_len]``) whose rows there are
    complete (see ``Trace``)."""
    by_id = {r.request_id: r for r in requests}
    for rid in sorted((rid for rid in traces if by_id[rid].cached_tokens), key=lambda r: by_id[r].cached_tokens):
        tr, P = traces[rid], by_id[rid].cached_tokens
        donor = next((d for d, t in traces.items() if d != rid and P <= t.filled
                      and (by_id[d].cached_tokens == 0 or t.prefix_from is not None)
                      and torch.equal(token_ids[d][:P], token_ids[rid][:P])), None)
        if donor is None:
            tr.missing = P
            continue
        src = traces[donor]
        for li in tr.x:
            tr.x[li][:P] = src.x[li][:P]
            tr.y[li][:P] = src.y[li][:P]
            if li in tr.entry_idx:
                tr.entry_idx[li][:P] = src.entry_idx[li][:P]
        tr.prefix_from = donor
