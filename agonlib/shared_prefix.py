"""Rows that begin with the same prompt tokens: finding them, and running their shared tokens once in training.

One role's rows in a step share prompt tokens: every row the system prompt and worked example(s), the N
drafts of a problem their whole prompt. ``share_prefixes`` groups consecutive rows where sharing saves
tokens. Training runs each group's prefix forward once (:class:`PrefixRun`), with the adapter active, and
each micro-batch of its rows attends to its keys and values; one backward pass through the prefix, run
again with its graph, then carries every row's gradient. Exact up to float rounding
(``tests/test_shared_prefix.py``); ``agonlib.grpo.build_batch`` lays a batch out this way. ``micro_batch_tokens`` counts each row's own tokens,
not the prefix's keys and values it attends to.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .generation.layout import share_prefixes

__all__ = ["PrefixRun", "share_prefixes", "shares_prefix_exactly"]


class PrefixRun:
    """One run of prompt tokens that several rows share, computed once: its keys and values per layer.

    The keys and values are computed without a graph and held as float32 leaves. Every row's backward
    pass sums its gradient with respect to them into the leaves (the rows attend to expanded views of
    one tensor), and :meth:`backward` then runs the prefix forward again, this time with its graph, and
    sends that sum through it once: the adapter receives exactly the gradient the rows would have sent
    through copies of the prefix of their own, up to float rounding (``tests/test_shared_prefix.py``).
    The second forward computes the same values with the same kernels, so the gradient is the one a
    graph kept from the first forward would give, bit for bit, without holding the prefix's activations
    while the rows' micro-batches run (``benchmarks/NOTES.md``).
    """

    def __init__(self, model, ids: torch.Tensor):
        self.length, self._model, self._ids = ids.numel(), model, ids
        self._adapter = getattr(model, "active_adapter", None)
        wanted = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
        with torch.no_grad():
            outputs = self._run()
        self._dtype = outputs[0].dtype
        # Leaves in float32 whatever the model's dtype: the rows' gradients add up there, as the adapters' do.
        self._leaves = [t.float().requires_grad_(wanted) for t in outputs]

    def _run(self) -> list[torch.Tensor]:
        """The prefix forward: its keys and values, ``(1, heads, L, d)`` each, layer by layer."""
        cache = DynamicCache()
        positions = torch.arange(self.length, device=self._ids.device)[None]  # (1, L)
        self._model(input_ids=self._ids[None], attention_mask=torch.ones_like(self._ids)[None],
                    position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]

    def cache(self, rows: int) -> DynamicCache:
        """A fresh cache holding the prefix for ``rows`` rows (views of the one copy; the model appends to it)."""
        kv = [leaf.to(self._dtype).expand(rows, -1, -1, -1) for leaf in self._leaves]
        return DynamicCache(ddp_cache_data=list(zip(kv[0::2], kv[1::2])))

    def backward(self) -> None:
        """The rows' summed gradients through the prefix's forward, run again with its graph (after every row's)."""
        if not any(leaf.grad is not None for leaf in self._leaves):
            return
        if getattr(self._model, "active_adapter", None) != self._adapter:
            raise RuntimeError(f"PrefixRun.backward under adapter {self._model.active_adapter!r}; its forward ran "
                               f"under {self._adapter!r}.")
        with torch.enable_grad():
            outputs = self._run()
        pairs = [(out, leaf.grad.to(out.dtype)) for out, leaf in zip(outputs, self._leaves)
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
