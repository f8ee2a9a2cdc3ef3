"""Spot check: a few traced requests of an engine run against ``dsv4.reference``.

For each traced request and layer, the reference runs the layer over the request's whole sequence (positions
``0 … L−1``) with exactly the inputs the engine fed that layer (recorded by ``Engine.trace``), and its output is
compared with the engine's, token by token. A request that started from a cached prefix is checked over its whole
sequence too: its prefix rows come from the traced request that computed them (``Trace.prefix_from``), so its own
rows — computed on the restored blocks, window and compressor state — are compared with a reference that
recomputes everything from the inputs. Layers are checked one at a time, so a difference cannot propagate
from one layer into the next one's check.

CSA top-k: the engine selects from its own index scores, which differ from the reference's by more than BF16
score rounding: its GEMMs round differently (other row blocks: a prefill chunk or a decode step against the
whole sequence), and a one-ulp change of an index query before its FP4 quantization can flip an E2M1 code.
Measured with the torch backend on the CPU (V4-Flash CSA layer, 4,096-token prompt + 64 decode steps): 321 of
4,160 rows select another set than the reference, 5 of them (decode rows) taking an entry whose reference score
is up to 1.7% of the row's largest |score| below one left out. On an H200 (V4-Flash layers 0, 2, 3, 4 requests ×
8,192-token prompts + 256 decode steps, 2026-11-24) the torch backend — the oracle of the Triton kernels — leaves
out entries up to 4.8% better on 7 of 16,896 rows and the Triton backend up to 5.1% on 4, every one a decode
token: a prefill chunk's GEMMs round the index queries as the reference's full-sequence GEMMs do, a decode step's
(a few rows) do not, and one flipped E2M1 code moves a query element by a whole quantization step. The keys flip
too: since the compressor projections run as one stacked GEMM (2026-11-28), the Triton backend left out entries
6.3% and 6.7% better on 2 prefill rows of 33,792 (H200, 4 requests), its ties reaching 6.0%. That is the
reference's own noise floor: ``tools/diag_topk_noise.py`` perturbs only the reference's compressor projections
by a relative 4e-6 (the measured distance between cuBLAS's stacked and separate GEMMs of these shapes) and finds,
over 8,448 tokens, 2,488–2,740 rows selecting another set, gaps up to 4.1–10.3% (0–4 rows above 2⁻⁴ per seed,
none above 2⁻³). A row therefore passes when its selection is a causal top-k of the reference scores up to
``TOPK_SLACK`` (2⁻³) of the row's largest |score|
(``reference.topk_within``: distinct, visible, ``min(k, visible)`` entries, nothing left out scoring more than the
slack above the lowest taken); such near-ties are excluded from the output comparison and counted. Anything else
— a wrong count, a future entry, a clearly better entry left out — fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import LayerKind
from ..reference import forward, topk_differences, topk_within
from .runner import Engine

__all__ = ["TOPK_SLACK", "SpotCheckRow", "spot_check", "tolerance"]

#: A CSA row's selection may leave out entries scoring up to this fraction of the row's largest |index score|
#: above the lowest entry it takes (a near-tie; measured: ≤ 6.7% for the engine on an H200, up to 10.3% for the
#: reference against itself with its compressor GEMMs summed in another order — see the module doc).
TOPK_SLACK = 2.0**-3


def tolerance(numerics: str, backend: str, device_type: str = "cpu") -> float:
    """Relative (Frobenius) tolerance of a layer's output against the reference.

    ``official``: BF16 activations and FP8 projections (activations quantized per 1×128 to E4M3), so the engine
    and the reference agree to BF16 rounding of GEMMs over different row blocks and of differently ordered kernel
    reductions — amplified where such a rounding difference moves a value across an E4M3 code boundary (one code is
    6–12% of the value; a BF16 difference of 2⁻⁸ crosses one with probability ≈ 2⁻⁸ / 2⁻³): torch backend on the
    CPU 5e-3 (it runs the reference's own projections: observed 0 on the tiny preset); on CUDA, where cuBLAS picks
    its blocking by the number of rows and the projections run as FP8 tensor-core GEMMs, 2e-2 for either backend
    (observed on an H200, V4-Flash, 5K-token requests: 9.6e-3 SWA, 1.04e-2 CSA, 1.0e-2 HCA with FP8 projections;
    ≤ 3.4e-3 when the projections ran in BF16). ``exact``: FP32 throughout (1e-4).
    """
    if numerics == "exact":
        return 1e-4
    return 5e-3 if backend == "torch" and device_type == "cpu" else 2e-2


@dataclass
class SpotCheckRow:
    """One (request, layer) comparison.

    Attributes:
        request_id, layer, kind: what was compared.
        tokens: sequence length compared.
        rel_err: ``‖y_engine − y_ref‖ / ‖y_ref‖`` over the tokens without a top-k tie.
        max_abs_err: largest absolute difference over those tokens.
        tie_rows: tokens excluded because the top-k sets differ by a near-tie only.
        topk_mismatch_rows: tokens whose selection is not a causal top-k of the reference scores within
            ``TOPK_SLACK`` (a failure).
        topk_mismatch_tokens: positions of the first (up to 8) of those tokens (prompt tokens come from prefill
            steps, later ones from decode steps).
        topk_worst_gap: the largest ``topk_within`` gap among them (best left-out minus lowest taken reference score,
            over the row's largest |score|; NaN for a structural failure alone: duplicate, non-causal or missing).
        tie_worst_gap: the largest gap among the tie rows (how close they came to ``TOPK_SLACK``).
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
    topk_mismatch_tokens: list[int] = field(default_factory=list)
    topk_worst_gap: float = 0.0
    tie_worst_gap: float = 0.0

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
        if tr.missing:
            raise RuntimeError(
                f"traced request {rid!r} started from a cached prefix of {tr.missing} tokens that no traced request "
                "computed: trace the request that computed it too (e.g. the first request of its prefix group)"
            )
        for li in tr.x:
            kind = engine.cfg.layer_kind(li)
            w = engine.full_weights(li).to(dev)
            x = tr.x[li].to(dev)
            ref = forward(w, engine.cfg, li, x, nm)
            y_eng = tr.y[li].to(dev).double()
            y_ref = ref.y.double()
            keep = torch.ones(tr.length, dtype=torch.bool, device=dev)
            ties = mismatch = 0
            where: list[int] = []
            worst = tie_worst = 0.0
            if kind is LayerKind.CSA and li in tr.entry_idx and ref.index_scores is not None:
                scores, got = ref.index_scores.float().cpu(), tr.entry_idx[li].cpu()
                differs, _ = topk_differences(scores, ref.entry_idx.cpu(), got)
                visible = (torch.arange(1, tr.length + 1) // engine.cfg.ratio(li)).clamp(max=scores.shape[1])
                within, gap = topk_within(scores, visible, got, engine.cfg.index_topk, TOPK_SLACK)
                ties = int((differs & within).sum())
                tie_worst = float(gap[differs & within].max()) if ties else 0.0
                mismatch = int((~within).sum())
                where = torch.nonzero(~within).flatten()[:8].tolist()
                bad_gaps = gap[(~within) & (gap > TOPK_SLACK)]
                worst = float(bad_gaps.max()) if bad_gaps.numel() else (float("nan") if mismatch else 0.0)
                keep = ~differs.to(dev)
            diff = (y_eng - y_ref)[keep]
            denom = y_ref[keep].norm().clamp_min(1e-30)
            rel = float(diff.norm() / denom) if bool(keep.any()) else 0.0
            max_abs = float(diff.abs().max()) if diff.numel() else 0.0
            finite = bool(torch.isfinite(y_eng).all())
            ok = finite and rel <= tol and mismatch == 0
            rows.append(SpotCheckRow(rid, li, kind.name, tr.length, rel if finite else float("nan"), max_abs, ties,
                                     mismatch, tol, ok, where, worst, tie_worst))
            del ref, x, w
    return rows
