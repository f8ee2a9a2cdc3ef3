"""Sparse attention with sink over the paged 584-B KV entries (SPEC §3 steps 5–6, §6)."""
