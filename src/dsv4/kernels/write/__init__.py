"""The write path's kernels (SPEC §3 step 3, §4, §7): window entries, the compressors' pooling into the paged
pool, and the SWA ring commit. ``plan`` decides a step's launches, ``launch`` / ``window`` run them."""
