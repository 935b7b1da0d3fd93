"""How prompts sit in a batch: each distinct prompt once, cut to size, left-padded, shared prefixes apart.

Every engine takes its prompts through these helpers: agonlib's decode loop,
the vLLM backend and its CPU stand-in. A prompt repeated for ``N`` generations
is tokenised and prefilled once (:func:`distinct`); an over-long prompt keeps
its end (:func:`cut_left`); rows are left-padded so that every row's next
token sits in the same column (:func:`left_padded`); and a prefix that a group
of prompts shares (a problem's challenges) can be prefilled once per group
(:func:`share_prefixes`, :func:`prompt_layout`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_SHARED = 16  # tokens: a shorter common prefix is not worth a prefill call of its own


def distinct(items: list) -> tuple[list, list[int]]:
    """``(each distinct item once, in first-seen order; the index of each item in that list)``."""
    position = {x: i for i, x in enumerate(dict.fromkeys(items))}
    return list(position), [position[x] for x in items]


def cut_left(ids: list[list[int]], max_len: int, stats=None) -> list[list[int]]:
    """Prompts longer than ``max_len`` tokens keep their end; each cut is logged and counted in ``stats``."""
    cut = sum(len(x) > max_len for x in ids)
    if cut:
        log.warning("%d prompt(s) longer than max_prompt_tokens=%d were cut from the left.", cut, max_len)
        if stats is not None:
            stats.prompts_truncated += cut
    return [x[-max_len:] for x in ids]


def left_padded(ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as left-padded ``input_ids`` and ``attention_mask``, both ``(U, T)``."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    return input_ids.to(device), mask.to(device)


@dataclass
class SharedPrefix:
    """Token prefixes that groups of prompts share, for an engine to prefill once per group."""

    input_ids: torch.Tensor  # (G, W) left-padded
    attention_mask: torch.Tensor  # (G, W)
    group: torch.Tensor  # (U,) the group of each prompt


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def share_prefixes(ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """Group consecutive prompts by a shared token prefix: ``(group of each prompt, prefix length of each group)``.

    A prompt joins the open group when that lowers the number of tokens to
    prefill (the group's prefix once, plus every member's suffix) and the
    group keeps at least ``MIN_SHARED`` shared tokens; a group's prefix leaves
    each member at least one token of its own, whose logits start the
    completion. The challenger's prompts of one problem share the system
    prompt, the worked example, the problem and the rival's introduction, and
    differ only from the summary on.
    """
    group, lengths = [], []
    first = 0  # the open group's first prompt
    for j, x in enumerate(ids):
        if lengths:
            members, shared = j - first, lengths[-1]
            joined = min(shared, _common_prefix(ids[first], x), len(x) - 1)
            # prefill cost with x in the group: sum(len) - members * joined; with x alone: sum(len) - (members-1) * shared
            if joined >= MIN_SHARED and members * joined > (members - 1) * shared:
                group.append(len(lengths) - 1)
                lengths[-1] = joined
                continue
        first = j
        group.append(len(lengths))
        lengths.append(len(x) - 1)
    return group, lengths


def prompt_layout(ids: list[list[int]], pad_id: int, device) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                       SharedPrefix | None]:
    """Left-padded prompts split into shared prefixes and suffixes where that saves work.

    Returns ``((input_ids, attention_mask) of the suffixes, prefix)``: without
    any shared prefix the suffixes are the whole prompts and ``prefix`` is ``None``.
    """
    group, lengths = share_prefixes(ids)
    if len(lengths) == len(ids):
        return left_padded(ids, pad_id, device), None
    heads = [ids[group.index(g)][:n] for g, n in enumerate(lengths)]
    tails = [x[lengths[g]:] for x, g in zip(ids, group)]
    prefix = SharedPrefix(*left_padded(heads, pad_id, device), torch.tensor(group, device=device))
    return left_padded(tails, pad_id, device), prefix
