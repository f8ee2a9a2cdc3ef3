"""The stages of one attention step over the cache (``append_swa``, compressor step, indexer top-k, ``gather``,
sparse attention with sink, ``visible_entries``). ``torch_ops`` runs on any device and is the oracle for kernels."""

from . import torch_ops

__all__ = ["torch_ops"]
