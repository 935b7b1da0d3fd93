"""The two engines agonlib's decode loop (:mod:`agonlib.generation.loop`) runs a model through.

An engine holds one batch's state — KV cache, attention mask, positions — and
answers three calls::

    engine.prefill(input_ids, attention_mask, max_new_tokens, prefix=None) -> (U, V) logits
    engine.select(rows)          # keep these batch rows, in this order (copy prompts to completions, evict)
    engine.step(next_ids)        # (b, 1) tokens in -> (b, V) logits of the next position

``active()`` is the context to run them in (the adapter switch of the
``transformers`` forward); ``shares_prefixes`` says whether ``prefill`` takes a
:class:`~agonlib.generation.layout.SharedPrefix`; ``evict_at`` is the share of
the batch that must have finished before finished rows leave it (their cache
copied away), for the loop's default.

* :class:`TransformersEngine` — the PEFT model's own forward and KV cache: any
  model, any adapter state (``decode_forward: transformers``, and the fallback).
* :class:`FastEngine` — :class:`agonlib.generation.fast.FastDecoder`, the
  adapter merged into fused weights and a preallocated KV cache
  (``decode_forward: auto`` on Llama/Qwen3).
"""

from __future__ import annotations

import contextlib

import torch

from . import fast
from .layout import SharedPrefix


def select_cache_rows(cache, rows: torch.Tensor):
    """Keep ``rows`` of a KV cache (in that order): a ``transformers`` ``Cache``, or the legacy tuple of
    per-layer ``(key, value)`` that Unsloth's patched Llama/Qwen3 forward returns outside its own
    ``generate()`` (``(b, heads, T, d)`` tensors). Returns the cache to use from now on."""
    if cache is None:
        return None
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(rows)
        return cache
    return tuple(tuple(t.index_select(0, rows) for t in layer) for layer in cache)


class TransformersEngine:
    """The model's ``transformers`` forward under ``adapter`` (``None``: the base), with its own KV cache."""

    shares_prefixes = False
    evict_at = 0.0  # a growing cache: a finished row leaves at once (one row selection per layer)

    def __init__(self, policies, adapter: str | None):
        self.policies, self.adapter = policies, adapter
        self.model, self.device = policies.model, policies.device

    def active(self):
        return self.policies.use(self.adapter)

    def prefill(self, input_ids, attention_mask, max_new_tokens: int, prefix: SharedPrefix | None = None):
        if prefix is not None:
            raise ValueError("TransformersEngine prefills whole prompts (shares_prefixes is False).")
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (U, T_prompt)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        self.cache, self.mask, self.position = out.past_key_values, attention_mask, positions[:, -1:]
        return out.logits[:, -1, :]  # (U, V)

    def select(self, rows: torch.Tensor) -> None:
        self.cache = select_cache_rows(self.cache, rows)
        self.mask, self.position = self.mask[rows], self.position[rows]

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(next_ids), 1)], dim=1)  # (b, T + 1)
        self.position = self.position + 1  # (b, 1)
        out = self.model(input_ids=next_ids, attention_mask=self.mask, position_ids=self.position,
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values  # the same Cache object; a new tuple from Unsloth's forward
        return out.logits[:, -1, :]  # (b, V)


class FastEngine:
    """A :class:`~agonlib.generation.fast.FastDecoder` (one adapter merged) and its preallocated KV cache."""

    shares_prefixes = True
    # Finished rows keep decoding (their tokens are ignored) until a quarter of the batch has finished;
    # then they leave in one copy of the KV cache, instead of one copy per finished row.
    evict_at = 0.25

    def __init__(self, decoder: "fast.FastDecoder"):
        self.decoder, self.device = decoder, decoder.device

    def active(self):
        return contextlib.nullcontext()

    def prefill(self, input_ids, attention_mask, max_new_tokens: int, prefix: SharedPrefix | None = None):
        """Run ``U`` left-padded prompts (their suffixes, after ``prefix``) into a fresh KV cache.

        With ``prefix``, the shared prefixes are run first, once per group, and
        each prompt starts from its group's cache: rows then have padding
        between prefix and suffix, which the mask hides and the positions
        (counted over real tokens only) skip.
        """
        U, width = input_ids.shape
        if prefix is None:
            cache = self.decoder.new_cache(U, width + max_new_tokens)
        else:
            G, shared = prefix.input_ids.shape
            cache = self.decoder.new_cache(G, shared + width + max_new_tokens)
            self.decoder.forward(prefix.input_ids, (prefix.attention_mask.cumsum(-1) - 1).clamp(min=0),
                                 prefix.attention_mask, cache)
            cache.select(prefix.group)  # (G, ...) -> (U, ...)
            attention_mask = torch.cat([prefix.attention_mask[prefix.group], attention_mask], dim=1)  # (U, T_prompt)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (U, T_prompt)
        logits = self.decoder.forward(input_ids, positions[:, cache.used :], attention_mask, cache)  # (U, V)
        self.cache, self.filled, self.position = cache, attention_mask.shape[1], positions[:, -1:]
        self.key_mask = torch.cat([attention_mask, attention_mask.new_zeros(U, max_new_tokens)], dim=1)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.key_mask, self.position = self.key_mask[rows], self.position[rows]

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        self.key_mask[:, self.filled] = 1
        self.filled += 1
        self.position = self.position + 1  # (b, 1)
        return self.decoder.forward(next_ids, self.position, self.key_mask, self.cache)  # (b, V)


def engine_for(policies, adapter: str | None):
    """The engine that samples ``adapter`` (``None``: the base) as the config's ``decode_forward`` asks.

    ``auto`` takes the fast decoder where it runs (a Llama/Qwen3 model loaded
    with transformers) and the ``transformers`` forward elsewhere; ``fast``
    says why it cannot run instead of falling back.
    """
    if adapter is not None and adapter not in getattr(policies.model, "peft_config", {adapter: None}):
        raise ValueError(f"No adapter {adapter!r}; adapters are {', '.join(policies.model.peft_config)} (or None for the base).")
    choice = policies.config.decode_forward
    loader = getattr(policies, "model_loader", None)
    usable = loader == "transformers" and fast.supports(policies.model)
    if choice == "fast" and not usable:
        raise ValueError(f"decode_forward=fast needs a Llama or Qwen3 model loaded with transformers; this is a "
                         f"{loader} {policies.model.config.model_type!r}. Use decode_forward=auto.")
    if choice == "transformers" or not usable:
        return TransformersEngine(policies, adapter)
    return FastEngine(fast.FastDecoder(policies.model, adapter))
