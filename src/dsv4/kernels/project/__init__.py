"""The layer's projections and what follows them directly: weighted RMSNorms and the queries' per-head RMSNorm +
RoPE (SPEC §3 steps 1–3); and what comes before them, the engine's residual add and input RMSNorm between layers
(``residual_norm``)."""
