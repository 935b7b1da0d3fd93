"""Rows that begin with the same prompt tokens: finding them, and running their shared tokens once in training.

One role's rows in a step share prompt tokens: every row the system prompt and worked example(s), the N
drafts of a problem their whole prompt. ``share_prefixes`` groups consecutive rows where sharing saves
tokens. Training runs each group's prefix forward once (:class:`PrefixRun`), with the adapter active and
gradients on, and each micro-batch of its rows attends to its keys and values; one backward pass through
the prefix then carries every row's gradient. Exact up to float rounding (``tests/test_shared_prefix.py``);
``agonlib.grpo.build_batch`` lays a batch out this way. ``micro_batch_tokens`` counts each row's own tokens,
not the prefix's keys and values it attends to.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .generation.layout import share_prefixes

__all__ = ["PrefixRun", "share_prefixes", "shares_prefix_exactly"]


class PrefixRun:
    """One run of prompt tokens that several rows share, computed once: its keys and values per layer.

    With gradients on, the keys and values are leaves cut from the prefix's own graph. Every row's
    backward pass sums its gradient with respect to them into the leaves (the rows attend to expanded
    views of one tensor), and :meth:`backward` then sends that sum through the prefix's graph once:
    the adapter receives exactly the gradient the rows would have sent through copies of the prefix
    of their own, up to float rounding (``tests/test_shared_prefix.py``).
    """

    def __init__(self, model, ids: torch.Tensor):
        self.length = ids.numel()
        cache = DynamicCache()
        positions = torch.arange(self.length, device=ids.device)[None]  # (1, L)
        model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], position_ids=positions,
              past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._outputs = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # (1, heads, L, d) each
        # Leaves in float32 whatever the model's dtype: the rows' gradients add up there, as the adapters' do.
        self._leaves = [t.detach().float().requires_grad_(t.requires_grad) for t in self._outputs]

    def cache(self, rows: int) -> DynamicCache:
        """A fresh cache holding the prefix for ``rows`` rows (views of the one copy; the model appends to it)."""
        kv = [leaf.to(out.dtype).expand(rows, -1, -1, -1) for leaf, out in zip(self._leaves, self._outputs)]
        return DynamicCache(ddp_cache_data=list(zip(kv[0::2], kv[1::2])))

    def backward(self) -> None:
        """The rows' summed gradients through the prefix's graph, once (after every row's backward pass)."""
        pairs = [(out, leaf.grad.to(out.dtype)) for out, leaf in zip(self._outputs, self._leaves)
                 if out.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def shares_prefix_exactly(model) -> bool:
    """Whether running a prefix once gives every row the computation it would have had on its own.

    Not under dropout (one mask would be shared by the rows; attention dropout is a config value, not a
    module) nor under gradient checkpointing (the recomputed forward would append to the cache again).
    """
    inner = getattr(model, "get_base_model", lambda: model)()
    if getattr(inner, "is_gradient_checkpointing", False) or getattr(getattr(inner, "config", None),
                                                                     "attention_dropout", 0):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
