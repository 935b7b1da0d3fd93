"""The decode loop: completions of a batch of prompts through one engine (:mod:`agonlib.generation.engines`).

One seed per completion, one generator each (:func:`~agonlib.generation.sampling.draw`),
so neither batch composition nor row order changes the random draws a completion
uses. Its logits can still move by float rounding with the batch: in bf16,
oneDNN rounds a product of 8–32 rows unlike one of 1 or of 64 or more, and a
batch passes through those sizes as its rows finish. In float32 200 held-out
drafts came out the same in batches of 64 and of 200, in bf16 only 85 of them
(``experiments/LOG.md``, 2026-12-06), so a bf16 run regenerates bit for bit
with the same batches only.
A prompt repeated for ``N`` generations is prefilled once and its KV cache
copied to its completions (``rows``); a prefix shared by a group of prompts is
prefilled once per group where the engine can (``shares_prefixes``). A row
ends at a stop token or, with ``answer_stop``, at the token that closes its
first answer box; finished rows leave the batch once ``evict_at`` of it has
finished, so the tail of long generations costs only the rows still running.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .layout import left_padded, prompt_layout
from .sampling import SamplingParams, draw, token_entropy
from .stops import AnswerStop


@torch.no_grad()
def decode_batch(engine, prompt_ids: list[list[int]], seeds, params: SamplingParams, stop_ids: list[int],
                 pad_id: int, rows=None, *, answer_stop: AnswerStop | None = None, evict_at: float | None = None,
                 share_prefixes: bool = True, desc: str = "", progress: bool = False,
                 entropy: torch.Tensor | None = None) -> torch.Tensor:
    """Decode one completion per seed; returns the drawn tokens ``(B, T_new)``, padded with ``pad_id``.

    ``prompt_ids`` holds ``U`` distinct prompts; ``rows[i]`` is the prompt of
    completion ``i`` (default: ``i``). ``evict_at`` (default: the engine's) is
    the share of the batch that must have finished before finished rows leave
    it; 0 drops each as soon as it finishes. ``share_prefixes``: prefill a prefix that
    prompts share once per group, where the engine can. Run it inside
    ``engine.active()``.
    """
    device = engine.device
    B = len(seeds)
    rows = torch.arange(B, device=device) if rows is None else torch.as_tensor(rows, device=device)
    evict_at = engine.evict_at if evict_at is None else evict_at
    generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    stops = torch.tensor(stop_ids, device=device)
    if share_prefixes and engine.shares_prefixes:
        (input_ids, attention_mask), prefix = prompt_layout(prompt_ids, pad_id, device)
    else:
        (input_ids, attention_mask), prefix = left_padded(prompt_ids, pad_id, device), None
    logits = engine.prefill(input_ids, attention_mask, params.max_new_tokens, prefix)[rows]  # (U, V) -> (B, V)
    engine.select(rows)  # (U, ...) -> (B, ...)
    tokens = torch.full((B, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    live = torch.arange(B, device=device)  # the completion each batch row belongs to
    running = torch.ones(B, dtype=torch.bool, device=device)
    steps = 0
    for t in tqdm(range(params.max_new_tokens), desc=desc or "generate", leave=False, disable=not progress):
        idx = running.nonzero().squeeze(1)
        token = draw(logits[idx], params, [generators[i] for i in live[idx].tolist()])  # (b_running,)
        if entropy is not None:
            entropy[live[idx]] += token_entropy(logits[idx], params)
        tokens[live[idx], t] = token
        steps = t + 1
        running[idx[torch.isin(token, stops)]] = False
        if answer_stop is not None:
            running[idx[answer_stop.finished_rows(live[idx], token, tokens, t)]] = False
        if not running.any() or t + 1 == params.max_new_tokens:
            break
        next_ids = torch.full((len(live), 1), pad_id, dtype=torch.long, device=device)  # finished rows: padding
        next_ids[idx, 0] = token
        finished = len(live) - int(running.sum())
        if finished and finished >= evict_at * len(live):
            keep = running.nonzero().squeeze(1)
            engine.select(keep)
            live, running, next_ids = live[keep], running[keep], next_ids[keep]
        logits = engine.step(next_ids)  # (b, V)
    return tokens[:, :steps]  # (B, T_new)
