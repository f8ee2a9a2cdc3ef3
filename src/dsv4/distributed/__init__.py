"""Beyond one device: tensor-parallel heads and a sequence-sharded (context-parallel) cache over
``torch.distributed`` (NCCL on GPUs, gloo on the CPU), started with ``torchrun``.

* ``Parallel`` (``settings``): a rank's process groups; ``Parallel.build(tp, cp)`` / ``init_from_env(tp, cp)``;
* ``sharding``: which heads and weight slices a TP rank holds (``AttentionWeights.shard``), the layer as a rank
  computes it (``local_config``);
* ``tp_ops``: the output projection's partial sums and their all-reduce;
* ``cp_ops``: the sharded pool's indexer top-k and attention; ``merge``: partial softmaxes merged by their
  log-sum-exp;
* ``ops``: a backend's ops with those stages swapped in (``dsv4.Attention(..., parallel=)``).

Without a ``Parallel`` nothing here runs: the one-process path has no collective and no extra host work.
"""

from .merge import MERGES
from .settings import CP_WINDOW_MODES, Parallel, init_from_env
from .sharding import check_fp8_split, local_config

__all__ = ["CP_WINDOW_MODES", "MERGES", "Parallel", "check_fp8_split", "init_from_env", "local_config"]
