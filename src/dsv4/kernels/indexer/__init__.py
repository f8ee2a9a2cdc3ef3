"""The lightning indexer's kernels (SPEC §5–6), in call order: the MXFP4 queries, the index scores over the paged
keys (Triton, and Gluon on Hopper), the top-k of each row."""
