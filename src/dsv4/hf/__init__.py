"""dsv4 inside ``transformers``: a DeepSeek-V4 model's attention served by dsv4's cache and kernels.

::

    from transformers import AutoModelForCausalLM
    import dsv4.hf

    model = AutoModelForCausalLM.from_pretrained(path)            # a DeepseekV4ForCausalLM
    dsv4.hf.attach(model, backend="auto", numerics="official")    # every layer's attention now runs in dsv4
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, return_dict_in_generate=True)
    cache = out.past_key_values                                   # a DSV4Cache (``out.cache`` in transformers 5.24)
    # follow-up turn: the whole conversation again, only its new tokens are computed
    out2 = model.generate(torch.cat([out.sequences, more], 1), attention_mask=..., past_key_values=cache, ...)

Modules: ``step`` (which columns of a padded batch are real tokens, at which positions; input checks), ``cache``
(``DSV4Cache``: the transformers ``Cache`` over a ``HybridCache``, one request per row, one ``prepare_forward``
per model step), ``attention`` (``LayerAdapter``: a ``DeepseekV4Attention`` forward run by ``dsv4.Attention``),
``attach`` (``attach`` / ``detach``), ``random_model`` (``random_causal_lm``: a random DeepseekV4ForCausalLM of a
``ModelConfig``'s geometry, and ``left_padded_prompts``, for examples, tests and benchmarks). Needs ``transformers``
with DeepSeek-V4 (``DeepseekV4ForCausalLM``; developed and tested with 5.24.0); ``import dsv4`` does not import
this package.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("dsv4.hf needs transformers (pip install transformers)") from e

from .attach import ATTN_IMPLEMENTATION, Attachment, attach, detach
from .cache import CacheSettings, DSV4Cache
from .random_model import left_padded_prompts, random_causal_lm
from .step import InconsistentInputError, RowTokens, row_tokens

__all__ = [
    "ATTN_IMPLEMENTATION", "Attachment", "CacheSettings", "DSV4Cache", "InconsistentInputError", "RowTokens", "attach",
    "detach", "left_padded_prompts", "row_tokens", "random_causal_lm",
]
