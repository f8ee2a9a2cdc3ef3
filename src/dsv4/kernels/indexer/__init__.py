"""The lightning indexer's kernels (SPEC §5–6): which entries each token of a CSA layer attends to.

Read in this order:

* ``plan`` — ``IndexerPlan``, every launch decision of a step (``scores_plan``: the scores' kernel and grid;
  ``topk_plan``: the top-k's algorithm and scratch), built once on the host by ``plan_indexer``;
* ``queries`` — the queries, RoPE → Hadamard → MXFP4, as FP8 operand bytes (``fp8_operands``: MXFP4 as exact E4M3);
* ``scores`` — ``index_scores``: ``Σ_h w_h · relu(q_h · k)`` of every query against its request's paged keys, in
  Triton or, for MXFP4 keys on Hopper, in Gluon (``scores_sm90``);
* ``topk`` — ``radix_topk``: the k best entries of each token's score row, by ``topk_bisect`` (``topk_bisect_sm90``
  on Hopper), ``topk_filter`` or ``topk_split`` (``topk_common``: what they share).

``dsv4.ops.triton_indexer`` glues them into the backend's ``indexer_queries`` / ``indexer_topk``. Importing this
package imports nothing; the plan modules need no Triton.
"""
