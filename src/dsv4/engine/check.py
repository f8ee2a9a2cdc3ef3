"""Spot check: a few traced requests of an engine run against ``dsv4.reference``.

For each traced request and layer, the reference runs the layer over the request's whole sequence (positions
``0 … L−1``) with exactly the inputs the engine fed that layer (recorded by ``Engine.trace``), and its output is
compared with the engine's, token by token. Layers are checked one at a time, so a difference cannot propagate
from one layer into the next one's check.

CSA top-k: the reference and the engine may break near-ties in the BF16 index scores differently (``torch.topk``
order, or a kernel's accumulation order moving a score by one BF16 ulp). Tokens whose selected sets differ are
classified with ``reference.topk_differences`` (selected scores equal up to ``TIE_REL``): near-ties are excluded
from the output comparison and counted; any other difference fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import LayerKind
from ..reference import forward, topk_differences
from .runner import Engine

__all__ = ["TIE_REL", "SpotCheckRow", "spot_check", "tolerance"]

#: Selected index scores that agree to this relative tolerance count as a tie (≈ 2 BF16 ulps).
TIE_REL = 2.0**-7


def tolerance(numerics: str, backend: str, device_type: str = "cpu") -> float:
    """Relative (Frobenius) tolerance of a layer's output against the reference.

    ``official``: BF16 activations, so the engine and the reference agree to BF16 rounding of GEMMs over
    different row blocks and of differently ordered kernel reductions: torch backend on the CPU 1e-3 (observed
    ≤ 3e-4); on CUDA, where cuBLAS picks its blocking by the number of rows, 1e-2 for either backend (observed on
    an H200: torch backend 1.9e-3 on CSA layers, Triton ≤ 4e-3). ``exact``: FP32 throughout (1e-4).
    """
    if numerics == "exact":
        return 1e-4
    return 1e-3 if backend == "torch" and device_type == "cpu" else 1e-2


@dataclass
class SpotCheckRow:
    """One (request, layer) comparison.

    Attributes:
        request_id, layer, kind: what was compared.
        tokens: sequence length compared.
        rel_err: ``‖y_engine − y_ref‖ / ‖y_ref‖`` over the tokens without a top-k tie.
        max_abs_err: largest absolute difference over those tokens.
        tie_rows: tokens excluded because the top-k sets differ by a near-tie only.
        topk_mismatch_rows: tokens whose top-k sets differ by more than a tie (a failure).
        tol: the tolerance ``rel_err`` was held to.
        passed: ``rel_err <= tol`` and no top-k mismatch.
    """

    request_id: str
    layer: int
    kind: str
    tokens: int
    rel_err: float
    max_abs_err: float
    tie_rows: int
    topk_mismatch_rows: int
    tol: float
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@torch.no_grad()
def spot_check(engine: Engine, device: torch.device | str | None = None) -> list[SpotCheckRow]:
    """Compare every traced request and layer of the last ``engine.run`` with the reference.

    Args:
        engine: an engine that ran with ``engine.trace(...)`` set.
        device: where the reference runs (default: the engine's device).
    Returns:
        one ``SpotCheckRow`` per (request, layer).
    """
    dev = torch.device(device) if device is not None else engine.device
    nm = engine.numerics
    backend = engine.backend
    tol = tolerance(nm.name, backend, dev.type)
    rows: list[SpotCheckRow] = []
    for rid, tr in engine.traces.items():
        if tr.filled < tr.length:
            raise RuntimeError(f"traced request {rid!r} recorded {tr.filled} of {tr.length} tokens (did it finish?)")
        for li in tr.x:
            kind = engine.cfg.layer_kind(li)
            w = engine.weights[li].to(dev)
            x = tr.x[li].to(dev)
            ref = forward(w, engine.cfg, li, x, nm)
            y_eng = tr.y[li].to(dev).double()
            y_ref = ref.y.double()
            keep = torch.ones(tr.length, dtype=torch.bool, device=dev)
            ties = mismatch = 0
            if kind is LayerKind.CSA and li in tr.entry_idx and ref.index_scores is not None:
                differs, tie_only = topk_differences(
                    ref.index_scores.float().cpu(), ref.entry_idx.cpu(), tr.entry_idx[li].cpu(), rel=TIE_REL
                )
                ties = int(tie_only.sum())
                mismatch = int((differs & ~tie_only).sum())
                keep = ~differs.to(dev)
            diff = (y_eng - y_ref)[keep]
            denom = y_ref[keep].norm().clamp_min(1e-30)
            rel = float(diff.norm() / denom) if bool(keep.any()) else 0.0
            max_abs = float(diff.abs().max()) if diff.numel() else 0.0
            finite = bool(torch.isfinite(y_eng).all())
            ok = finite and rel <= tol and mismatch == 0
            rows.append(SpotCheckRow(rid, li, kind.name, tr.length, rel if finite else float("nan"), max_abs, ties,
                                     mismatch, tol, ok))
            del ref, x, w
    return rows
