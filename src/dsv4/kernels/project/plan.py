"""How a step's FP8 projections run (``ProjectionPlan``), decided once per step from its row count.

The five FP8 projections of a layer (``weights.FP8_PROJECTIONS``) have fixed shapes, and so have the stack of the
two that read the layer's input (``wq_a+wkv``, ``dsv4.input_stack``) and, CSA, of the two that read the query
latent (``wq_b+indexer.wq_b``, ``dsv4.query_stack``); a step multiplies each by ``rows`` activation rows (its
tokens). Per weight shape the plan holds the Triton block GEMM's launch (``block_gemm.gemm_config``) where that
kernel was measured faster, else the way ``fp8_gemm.fp8_linear`` runs it: the device's FP8 tensor-core GEMM
(``fallback``: ``torch._scaled_mm``, ``"scaled_mm"``, where it works) or cuBLAS's BF16 GEMM over the quantized
values (``"bf16"``: the same products summed exactly in FP32).

FP8 tensor cores sum each 128-wide K block with about 1.3e-4 relative error (the Triton block GEMM and cuBLAS's
blockwise GEMM alike; the official model's FP8 kernels too). Projections whose outputs the layer quantizes again
— ``wq_a+wkv`` (the FP8 KV cache, ``c^Q``'s FP8 activations) and ``wq_b+indexer.wq_b`` (the MXFP4 index
queries) — take the exact BF16 way on prefill rows: on every projection of a prefill chunk those sums moved a CSA
top-k row beyond the spot check's tie slack. ``wq_b`` and ``wo_b``, the two largest, take the fallback; so the
query stack, whose parts then take different ways, runs as its parts (``unstacked``). The rule's figures:
``benchmarks/RESULTS.md``, "FP8 projections".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...config import ModelConfig
from .block_gemm import GemmConfig, gemm_config

__all__ = ["EXACT_SUMS", "STACK_PARTS", "ProjectionPlan", "fp8_projection_shapes", "plan_projections",
           "triton_gemm_wins"]

#: steps of at most this many rows (decode) take the Triton GEMM ...
TRITON_ROWS = 64
#: ... for weights of at least this many values (V4-Flash: ``wq_b``, ``wo_b``, 32 Mi each; the smaller ones are
#: launch-latency bound either way) ...
TRITON_MIN_VALUES = 1 << 24
#: ... and for the stacks whatever their size: one launch instead of a cuBLAS chain (activation quantization,
#: split-K GEMM, its reduce) per stacked weight below that size (``wq_a`` and ``wkv``; the indexer's ``wq_b``)
TRITON_STACKS = ("wq_a+wkv", "wq_b+indexer.wq_b")
#: projections whose outputs the layer quantizes again (FP8 KV cache and activations, MXFP4 index queries): on
#: prefill rows their products are summed exactly (the ``"bf16"`` way), never on FP8 tensor cores
EXACT_SUMS = ("wq_a", "wkv", "wq_a+wkv", "indexer.wq_b", "wq_b+indexer.wq_b")
#: each stack's parts: a stack without a Triton launch whose parts run different ways runs as its parts
STACK_PARTS = {"wq_a+wkv": ("wq_a", "wkv"), "wq_b+indexer.wq_b": ("wq_b", "indexer.wq_b")}


def fp8_projection_shapes(cfg: ModelConfig, heads: int | None = None) -> dict[str, tuple[int, int]]:
    """``{name: (N, K)}`` of a layer's FP8 projections and of the stacks ``wq_a+wkv`` and (CSA)
    ``wq_b+indexer.wq_b`` (``heads``: the query heads a rank computes — its ``wq_b`` rows; a tensor-parallel rank
    holds their share of the output groups, ``G·heads/H``, and so of ``wo_b``'s columns; the indexer is whole on
    every rank)."""
    H = cfg.num_heads if heads is None else heads
    d = cfg.hidden_size
    groups = cfg.o_groups * H // cfg.num_heads
    index_rows = cfg.index_n_heads * cfg.index_head_dim
    return {"wq_a": (cfg.q_lora_rank, d), "wq_b": (H * cfg.head_dim, cfg.q_lora_rank), "wkv": (cfg.head_dim, d),
            "wq_a+wkv": (cfg.q_lora_rank + cfg.head_dim, d),
            "wo_b": (d, groups * cfg.o_lora_rank),
            "indexer.wq_b": (index_rows, cfg.q_lora_rank),
            "wq_b+indexer.wq_b": (H * cfg.head_dim + index_rows, cfg.q_lora_rank)}


def triton_gemm_wins(rows: int, n: int, k: int, name: str = "") -> bool:
    """Whether the Triton block GEMM beats cuBLAS over the quantized values for weight ``name`` of this shape
    (measured on the H200: decode rows over a large weight, or over a stack)."""
    return rows <= TRITON_ROWS and (n * k >= TRITON_MIN_VALUES or name in TRITON_STACKS)


@dataclass(frozen=True)
class ProjectionPlan:
    """A step's FP8-projection launches.

    Attributes:
        rows: activation rows per projection (the step's tokens).
        fallback: the device's way for shapes without a Triton launch (``fp8_gemm.GEMMS``).
        launches: ``{(N, K): GemmConfig}`` — the Triton block GEMM's launch per weight shape that takes it.
        exact: the shapes without a launch that take the ``"bf16"`` way whatever the fallback (``EXACT_SUMS``).
        unstacked: the stacks' shapes that run as their parts (``STACK_PARTS``: the parts take different ways —
            a prefill chunk's ``wq_b`` on FP8 tensor cores, the indexer's ``wq_b`` exactly).
    """

    rows: int
    fallback: str
    launches: dict[tuple[int, int], GemmConfig] = field(default_factory=dict)
    exact: frozenset[tuple[int, int]] = frozenset()
    unstacked: frozenset[tuple[int, int]] = frozenset()

    def launch(self, n: int, k: int) -> GemmConfig | None:
        """The Triton launch of an ``[n, k]`` weight, or ``None`` (``way``)."""
        return self.launches.get((n, k))

    def takes_codes(self, n: int, k: int) -> bool:
        """Whether the ``[n, k]`` weight's GEMM reads activations quantized by the launch that made them (its
        Triton launch is a TMA one: ``block_gemm.block_fp8_linear``'s ``codes``)."""
        launch = self.launches.get((n, k))
        return launch is not None and launch.tma

    def way(self, n: int, k: int) -> str:
        """How an ``[n, k]`` weight without a Triton launch runs (``fp8_gemm.fp8_linear``'s ``gemm``)."""
        return "bf16" if (n, k) in self.exact else self.fallback

    def stacked(self, n: int, k: int) -> bool:
        """Whether the stacked ``[n, k]`` weight runs as one GEMM (else as its parts, each its own way)."""
        return (n, k) not in self.unstacked

    def describe(self) -> str:
        def listed(shapes: frozenset[tuple[int, int]]) -> str:
            return ", ".join(f"{n}x{k}" for n, k in sorted(shapes))

        ways = f"{self.fallback} GEMMs over the quantized values"
        if self.exact and self.fallback != "bf16":
            ways += f" (bf16 for {listed(self.exact)})"
        if self.unstacked:
            ways += f", the stacks {listed(self.unstacked)} as their parts"
        if not self.launches:
            return f"{ways} ({self.rows} rows)"
        shapes = ", ".join(f"{n}x{k} ({c.describe()})" for (n, k), c in self.launches.items())
        return f"Triton block GEMM for {shapes}; else {ways} ({self.rows} rows)"


def plan_projections(rows: int, shapes: dict[str, tuple[int, int]], fallback: str, sms: int,
                     triton_gemm: bool) -> ProjectionPlan:
    """The plan for a step of ``rows`` rows over these weight shapes (``{name: (N, K)}``); ``triton_gemm``: the
    device runs the Triton block GEMM (FP8 tensor cores: Hopper)."""
    launches = {}
    if triton_gemm and rows > 0:
        for name, (n, k) in shapes.items():
            if triton_gemm_wins(rows, n, k, name):
                launches[(n, k)] = gemm_config(rows, n, k, sms)
    exact = frozenset(shape for name, shape in shapes.items() if name in EXACT_SUMS and shape not in launches)
    plan = ProjectionPlan(rows=rows, fallback=fallback, launches=launches, exact=exact)

    def way(name: str) -> str:
        return "triton" if shapes[name] in launches else plan.way(*shapes[name])

    unstacked = frozenset(shapes[stack] for stack, parts in STACK_PARTS.items()
                          if stack in shapes and all(p in shapes for p in parts)
                          and shapes[stack] not in launches and len({way(p) for p in parts}) > 1)
    return dataclasses.replace(plan, unstacked=unstacked)
