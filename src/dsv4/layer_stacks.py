"""Every stack a layer's weights take so that matrices reading the same input run as one GEMM
(``dsv4.weight_stack``): the compressors' (``dsv4.compressor_stack``), ``[W_qa; W_kv]`` (``dsv4.input_stack``) and,
CSA, ``[W_qb; W_Iq]`` (``dsv4.query_stack``). ``Attention`` stacks its device weights with it, the engine its
weights as it loads them."""

from __future__ import annotations

from .compressor_stack import stack_compressor_weights
from .input_stack import stack_input_projections
from .query_stack import stack_query_projections
from .weights import AttentionWeights

__all__ = ["stack_layer_weights"]


def stack_layer_weights(w: AttentionWeights) -> AttentionWeights:
    """A copy of ``w`` (the same tensors) holding every stack its matrices can take, each stacking keeping the
    others'; a stack is the weights' own memory when they already lie stacked, else one copy. Projections that are
    not block-scaled FP8 (the exact numerics) stay unstacked."""
    return stack_query_projections(stack_input_projections(stack_compressor_weights(w)))
