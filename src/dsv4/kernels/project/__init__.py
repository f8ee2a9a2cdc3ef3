"""The layer's projections and what follows them directly: weighted RMSNorms and the queries' per-head RMSNorm +
RoPE (SPEC §3 steps 1–3)."""
