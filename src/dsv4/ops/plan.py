"""``StepPlan``: every launch decision of one step, made once on the host and read by every layer's ops.

Built by the backend's ``plan_step(batch, cache)`` right after ``HybridCache.prepare_forward`` (``dsv4.Attention``
builds it on first use and keeps it on the batch when the caller does not pass one). It holds one ``LayerPlan`` per
layer kind the cache holds — all layers of a kind share the step's geometry, so they share its decisions — and
depends only on the batch's fixed-shape geometry, never on positions: a CUDA graph captured with it stays right
on later steps of the same shape (FlashInfer's ``plan()`` / ``run()``; vLLM's metadata builders; FlashMLA's
scheduler metadata, likewise reused across layers).

A stage whose plan is ``None`` runs the torch backend's op (the kernels do not handle that format or geometry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import LayerKind

__all__ = ["LayerPlan", "StepPlan"]


@dataclass(frozen=True)
class LayerPlan:
    """One layer kind's launch decisions for a step.

    Attributes:
        kind: the layer kind.
        kernels: the Triton kernels run this layer's norms and queries (a CUDA device or the interpreter, BF16
            activations); the stages below say which of the cache's formats they also handle.
        projection: how the FP8 projections run (``kernels.project.plan.ProjectionPlan``; ``None``: the torch
            reference's ``project``, e.g. without FP8 projections in the numerics).
        write: ``kernels.write.plan.WritePlan`` of the writes before attention (``None``: torch).
        indexer: the CSA indexer's plan (scores kernel and top-k; ``None``: torch, or not a CSA layer).
        attention: the sparse attention's plan (kernel, splits, key source, merge; ``None``: torch).
        overlap: two stages run on a second CUDA stream (``ops.side_stream.SideStream``): the writes before
            attention beside the query path, the ring commit beside the output projection. ``False``: every
            launch on the current stream (the torch backend; no CUDA streams; a layer whose writes run the torch
            ops).
    """

    kind: LayerKind
    kernels: bool = False
    projection: Any = None
    write: Any = None
    indexer: Any = None
    attention: Any = None
    overlap: bool = False

    def describe(self) -> list[str]:
        """One line per planned stage."""
        lines = [f"projections: {self.projection.describe()}"] if self.projection is not None else []
        for stage in ("write", "indexer", "attention"):
            p = getattr(self, stage)
            if p is not None:
                lines.append(f"{stage}: {p.describe()}")
            elif stage != "indexer" or self.kind is LayerKind.CSA:
                lines.append(f"{stage}: torch")
        if self.overlap:
            lines.append("streams: the writes beside the queries, the ring commit beside the output (a second stream)")
        return lines


@dataclass(frozen=True)
class StepPlan:
    """The launch decisions of one step, per layer kind.

    Attributes:
        backend: the backend that made it (``"torch"`` makes none).
        layers: ``{LayerKind: LayerPlan}`` for every kind the cache holds.
        summary: the step's shape in a few words (requests, tokens, most new tokens per request).
        shape: ``StepBatch.shape_key()`` of the batch it was made for (``None``: the torch backend's empty plan,
            valid for any batch); a layer refuses a plan made for another shape.
    """

    backend: str
    layers: dict[LayerKind, LayerPlan] = field(default_factory=dict)
    summary: str = ""
    shape: tuple | None = None

    @classmethod
    def empty(cls, backend: str) -> StepPlan:
        return cls(backend)

    def fits(self, batch_shape: tuple) -> bool:
        """Whether this plan was made for batches of this ``StepBatch.shape_key()``."""
        return self.shape is None or self.shape == batch_shape

    def layer(self, kind: LayerKind) -> LayerPlan:
        """The plan of ``kind`` (an empty plan where none was made: every stage runs torch)."""
        plan = self.layers.get(kind)
        return plan if plan is not None else LayerPlan(kind)

    def describe(self) -> str:
        """The plan in a few lines (``dsv4 run --explain``)."""
        head = f"step plan ({self.backend}{', ' + self.summary if self.summary else ''})"
        if not self.layers:
            return f"{head}: no kernel launches to plan"
        out = [head + ":"]
        for kind, lp in sorted(self.layers.items(), key=lambda kv: list(LayerKind).index(kv[0])):
            out.append(f"  {kind.name}:")
            out.extend(f"    {line}" for line in lp.describe())
        return "\n".join(out)
