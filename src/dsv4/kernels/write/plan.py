"""The write path's launch decisions for one step (``WritePlan``), made once on the host from the step's shape.

A layer's writes before attention are one launch (``write.compressor``), two for a CSA prefill chunk
(``write.csa_entries`` for the entries, then the fused launch's state updates). How many programs of which role it
has, and how they are compiled, depends only on the step's fixed-shape geometry — the requests, their most new
tokens, the padded emit list's length — never on positions, so a CUDA graph captured with a plan replays right.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..torch_order import TORCH_REDUCE_MAX_THREADS, pool_warps

__all__ = ["CSA_PREFILL_TOKENS", "TOKENS_PER_PROGRAM", "WritePlan", "plan_write"]

#: tokens per window-entry program (fused launch, ``csa_entries`` and SWA layers' own launch)
TOKENS_PER_PROGRAM = 4
#: longest step (tokens of one request) for which CSA-style fused launches keep 4 warps per program; longer take 2
#: (more programs in flight for a prefill chunk's latency-bound entries; see benchmarks/RESULTS.md, "write path")
CSA_PREFILL_TOKENS = 256
#: HCA entries (≥ 64 slots × 512 channels) are pooled by this many programs, one channel slice each
HCA_POOL_PARTS = 8


@dataclass(frozen=True)
class WritePlan:
    """How one layer kind's writes before attention are launched in a step.

    Attributes:
        ratio: the compression ratio m (0: an SWA layer, whose only launch is its window entries').
        overlap: CSA-style pooling of ``2m`` slots (the previous window's first half + the own window).
        has_index: the CSA indexer's compressor runs in the same launches.
        requests: lead programs per compressor (B).
        entry_programs: entry programs per compressor: ``emit_capacity[m]`` (the padded emit list) when a request
            can emit more entries than its lead program takes, else 0 (decode steps: leads only).
        separate_entries: the entries and window entries run first in ``csa_entries``' launch (one warp per
            entry); the fused launch then does only the leads' state updates.
        parts: programs per entry, one channel slice each (``HCA_POOL_PARTS`` for HCA, else 1).
        pool_warps: warps torch's reduce kernel splits the main compressor's slot sums over (0: one thread per
            channel); ``pool_warps_index`` the same for the indexer's compressor (``torch_order.pool_warps``).
        warps: warps per program of the fused launch.
        window_programs: programs of the step's window entries, ``⌈T / TOKENS_PER_PROGRAM⌉``.
        grid: programs of the fused launch (SWA: the window entries' launch).
        csa_entries_grid: programs of ``csa_entries``' launch (0 unless ``separate_entries``).
        scratch_rows: rows of the fp32 ``[rows, 512]`` RMSNorm scratch and of the int32 arrival counters.
    """

    ratio: int
    overlap: bool
    has_index: bool
    requests: int
    entry_programs: int
    separate_entries: bool
    parts: int
    pool_warps: int
    pool_warps_index: int
    warps: int
    window_programs: int
    grid: int
    csa_entries_grid: int
    scratch_rows: int

    def describe(self) -> str:
        if self.ratio == 0:
            return f"window entries: 1 launch x {self.grid} programs"
        roles = "leads" + (f" + {self.entry_programs} entry programs" if self.entry_programs else "")
        if self.separate_entries:
            return (f"compressors m={self.ratio}: csa_entries {self.csa_entries_grid} programs (entries + window), "
                    f"then state updates {self.grid} programs")
        return (f"compressors m={self.ratio}{' + indexer' if self.has_index else ''}: 1 launch x {self.grid} "
                f"programs ({self.requests} {roles}, x{self.parts} parts, {self.window_programs} window), "
                f"{self.warps} warps")


def plan_write(*, ratio: int, overlap: bool, has_index: bool, tokens: int, requests: int, max_new: int,
               emit_capacity: int, parts: int | None = None, separate_entries: bool | None = None) -> WritePlan:
    """The write launches of a layer of ratio ``ratio`` (0: SWA) for a step of ``tokens`` new tokens over
    ``requests`` requests, at most ``max_new`` per request, whose padded emit list holds ``emit_capacity``
    entries (``StepBatch.emit_capacity[ratio]``).

    The rules: entry programs when a request can emit more entries than its lead takes (1; CSA 2); HCA entries
    (m ≥ 64) in ``HCA_POOL_PARTS`` channel slices; a CSA step with entry programs (m = 4) runs them in
    ``csa_entries``' own launch; 2 warps per fused program for CSA steps of more than ``CSA_PREFILL_TOKENS`` tokens
    per request. ``parts`` / ``separate_entries`` force another launch shape of the same kernels (tests run those
    code paths at the tiny preset's small ratios)."""
    window_programs = -(-tokens // TOKENS_PER_PROGRAM)
    if ratio == 0:
        return WritePlan(0, False, False, requests, 0, False, 1, 0, 0, 4, window_programs, window_programs, 0, 0)
    compressors = 1 + has_index
    lead_entries = 2 if overlap else 1
    entry_programs = emit_capacity if -(-max_new // ratio) > lead_entries else 0
    if parts is None:
        parts = HCA_POOL_PARTS if ratio >= 64 and not overlap else 1
    separate = entry_programs > 0 and overlap and (ratio == 4 if separate_entries is None else separate_entries)
    if separate:
        grid = requests * compressors
        csa_grid = entry_programs * compressors + window_programs
        warps = 4
    else:
        grid = (requests + entry_programs) * compressors * parts + window_programs
        csa_grid = 0
        warps = 2 if overlap and max_new > CSA_PREFILL_TOKENS else 4
    return WritePlan(
        ratio=ratio, overlap=overlap, has_index=has_index, requests=requests, entry_programs=entry_programs,
        separate_entries=separate, parts=parts,
        pool_warps=pool_warps(2 * ratio if overlap else ratio, TORCH_REDUCE_MAX_THREADS),
        pool_warps_index=pool_warps(2 * ratio, TORCH_REDUCE_MAX_THREADS), warps=warps,
        window_programs=window_programs, grid=grid, csa_entries_grid=csa_grid,
        scratch_rows=(requests + entry_programs) * compressors,
    )
