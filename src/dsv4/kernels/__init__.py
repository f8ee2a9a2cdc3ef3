"""Triton / Gluon kernels for Hopper GPUs, by stage of a layer step (``docs/architecture.md``):

* ``project``   — the FP8 projections, the layer's RMSNorms, the queries' per-head RMSNorm + RoPE, and the
  engine's glue around the layers (the residual add + norm, the hashed hidden states);
* ``write``     — window entries, the compressors' pooling into the paged pool, the SWA ring commit;
* ``indexer``   — the lightning indexer: MXFP4 queries, paged scores, top-k;
* ``attention`` — sparse attention with sink over window ∪ compressed entries.

Each stage has a ``plan`` (its launch decisions for a step, host only) and launchers that consume it. Shared:
``device`` (device facts, entry layout), ``constants`` (the layout as Triton constexprs), ``quant`` (number-format
device helpers), ``rope``, ``torch_order`` (torch's reduction orders), ``ptx`` (inline-PTX texts).
``dsv4.ops.triton_*`` glue them into the backend interface (``dsv4.ops.backend``).
"""
