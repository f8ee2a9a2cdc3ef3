"""Sparse attention with sink over the paged 584-B KV entries (SPEC §3 steps 5–6, §6): one step, in call order.

* ``plan``            ``plan_attention`` → ``AttentionPlan``: every launch decision of the step (kernel, splits,
                      key source, merge, tiling) from plain host numbers; no Triton needed.
* ``launch``          ``sparse_attention_fwd``: plans (``plan_for``) or takes a plan, then ``run`` launches it.
* ``args``            ``AttentionArgs``: the four kernels' shared arguments, built once per step.
* ``bf16_keys``       the step's keys dequantized once into BF16 rows (``keys="bf16"`` plans: prefill chunks).
* ``triton_kernel``   the Triton kernel (any GPU; the interpreter).
* ``sm90_serial``     the Hopper kernel in Gluon (every warpgroup does every phase), also merging splits in clusters
                      (``cluster_launch``); ``sm90_common`` / ``sm90_output``: the building blocks the Gluon kernels
                      share.
* ``sm90_ws``         the warp-specialized Hopper kernel (long key lists).
* ``sm90_pipelined``  persistent programs of a copy (``sm90_pipelined_copy``), a score and a value warpgroup.
* ``combine``         the merge of split partials by a second launch.

This package imports nothing itself, so that CPU-only installs can import ``plan``.
"""
