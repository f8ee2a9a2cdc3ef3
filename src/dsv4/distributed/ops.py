"""A backend's ops with the parallel stages swapped in (what ``dsv4.Attention`` runs when given a ``Parallel``).

* tensor parallelism: ``output`` (the rank's heads' partial output, all-reduced: ``tp_ops``); the other ops run
  unchanged on the rank's ``H/tp`` heads (the layer step's config, ``Parallel.local_config``), and the Triton
  backend plans its kernels for those heads;
* context parallelism (CSA / HCA layers): ``indexer_topk`` and ``attend`` over the sharded pool (``cp_ops``);
  the writes go through the cache's geometry (``torch_ops.new_entries`` writes the entries the rank holds).
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

from ..config import LayerKind
from ..ops.backend import OP_NAMES
from . import cp_ops, tp_ops
from .settings import Parallel

__all__ = ["parallel_ops"]


def parallel_ops(base: ModuleType, parallel: Parallel, kind: LayerKind, heads: int) -> SimpleNamespace:
    """``base``'s ops (``ops.backend``) for a layer of ``kind`` whose rank holds ``heads`` query heads, with the
    stages ``parallel`` splits replaced. Context parallelism runs on the torch backend only."""
    ops = SimpleNamespace(NAME=base.NAME, GRAPH_SAFE=base.GRAPH_SAFE,
                          **{name: getattr(base, name) for name in (*OP_NAMES, "plan_step")})
    if base.NAME == "triton":
        ops.plan_step = functools.partial(base.plan_step, heads=heads)
    if parallel.tp_size > 1:
        ops.output = functools.partial(tp_ops.output, group=parallel.tp_group)
    if parallel.cp_size > 1 and kind is not LayerKind.SWA:
        if base.NAME != "torch":
            raise ValueError(f"context parallelism runs the torch backend's ops; the {base.NAME} backend does not "
                             "read a sharded pool yet")
        ops.GRAPH_SAFE = False
        ops.indexer_topk = functools.partial(cp_ops.indexer_topk, group=parallel.cp_group)
        ops.attend = functools.partial(cp_ops.attend, group=parallel.cp_group, window_mode=parallel.cp_window,
                                       merge=parallel.cp_merge)
    return ops
