"""Batched sampling under one adapter, with a seed per completion.

``generate(policies, prompts, adapter, seeds)`` left-pads the prompts, prefills
them once and decodes with a KV cache. Every completion has its own
``torch.Generator`` seeded from ``(seed, step, problem, sample)`` (see
:func:`sample_seed`), so a completion does not depend on which other prompts
share its batch's random stream, and a resumed run replays the same draws.

Sampling follows ``transformers``' order of warpers: temperature, then top-k,
then top-p (nucleus), then one multinomial draw.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .parsing import split_completion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128

    @classmethod
    def from_config(cls, config) -> "SamplingParams":
        return cls(config.temperature, config.top_p, config.top_k, config.max_new_tokens)


@dataclass
class Rollout:
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the stop token
    text: str
    think: str
    summary: str
    answer: str | None
    length: int  # completion tokens
    truncated: bool  # no stop token within max_new_tokens
    seed: int
    extra: dict = field(default_factory=dict)


@dataclass
class GenerationStats:
    seconds: float = 0.0
    tokens: int = 0  # generated, padding excluded
    decode_steps: int = 0
    prompts_truncated: int = 0  # prompts longer than max_prompt_tokens, cut from the left


def sample_seed(seed: int, step: int, problem: int, sample: int, role: str = "") -> int:
    """A 63-bit seed from the coordinates of one completion; stable across Python runs."""
    key = f"{seed}/{step}/{problem}/{sample}/{role}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on ``(B, V)`` float logits; removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``(B, V)`` logits, row ``i`` drawn with ``generators[i]``; returns ``(B,)``.

    Inverse-CDF sampling: one uniform per row against the float64 cumulative
    distribution, the same categorical distribution as ``torch.multinomial``
    (which would draw ``V`` exponentials per row: 1.3 ms each at ``V = 49k``
    on this CPU). Tokens removed by top-k/top-p have zero mass and are never
    drawn: the search lands on the first index whose cumulative mass exceeds
    the uniform.
    """
    probs = warp_logits(logits.float(), params).softmax(-1)  # (B, V)
    cdf = probs.double().cumsum(-1)  # (B, V)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device) for g in generators])  # (B,)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)  # (B,)
    return token.clamp_(max=logits.shape[-1] - 1)


@torch.no_grad()
def sample_batch(model, input_ids, attention_mask, seeds, params: SamplingParams,
                 stop_ids: list[int], pad_id: int, rows=None, desc: str = "", progress: bool = False):
    """Decode completions of a left-padded batch of ``U`` prompts; returns ``(B, T_new)`` ids.

    ``rows[i]`` is the prompt row of completion ``i`` (default: ``i``): a prompt
    repeated for ``N`` generations is prefilled once and its KV cache copied.
    Finished completions leave the batch, so the tail of long generations costs
    only the rows still running. Each completion draws from its own generator,
    so neither changes what a completion samples.
    """
    device = input_ids.device
    B = len(seeds)
    rows = torch.arange(B, device=device) if rows is None else torch.as_tensor(rows, device=device)
    generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    stops = torch.tensor(stop_ids, device=device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (U, T_prompt)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    if cache is not None:
        cache.reorder_cache(rows)  # (U, ...) -> (B, ...)
    logits = out.logits[rows, -1, :]  # (B, V)
    attention_mask, position = attention_mask[rows], position_ids[rows, -1:]  # (B, T_prompt), (B, 1)
    tokens = torch.full((B, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    live = torch.arange(B, device=device)  # the completion each running row belongs to
    steps = 0
    for t in tqdm(range(params.max_new_tokens), desc=desc or "generate", leave=False, disable=not progress):
        token = draw(logits, params, [generators[i] for i in live.tolist()])  # (b,)
        tokens[live, t] = token
        steps = t + 1
        done = torch.isin(token, stops)
        if done.all() or t + 1 == params.max_new_tokens:
            break
        if done.any():  # drop finished rows from the batch and the cache
            keep = (~done).nonzero().squeeze(1)
            live, token, attention_mask, position = live[keep], token[keep], attention_mask[keep], position[keep]
            if cache is not None:
                cache.reorder_cache(keep)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=1)
        position = position + 1  # (b, 1)
        out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :]
    return tokens[:, :steps]  # (B, T_new)


@torch.no_grad()
def prefill(decoder, input_ids, attention_mask, max_new_tokens: int, prefix: "SharedPrefix | None" = None):
    """Run ``U`` left-padded prompts (their suffixes, with ``prefix``) into a fresh KV cache.

    Returns the last position's logits ``(U, V)``, the cache (room for
    ``max_new_tokens`` more), and the whole prompts' attention mask and rotary
    positions ``(U, T_prompt)``. With ``prefix``, the shared prefixes are run
    first, once per group, and each prompt starts from its group's cache: rows
    then have padding between prefix and suffix, which the mask hides and the
    positions (counted over real tokens only) skip.
    """
    U, width = input_ids.shape
    if prefix is None:
        cache = decoder.new_cache(U, width + max_new_tokens)
    else:
        G, shared = prefix.input_ids.shape
        cache = decoder.new_cache(G, shared + width + max_new_tokens)
        decoder.forward(prefix.input_ids, (prefix.attention_mask.cumsum(-1) - 1).clamp(min=0), prefix.attention_mask,
                        cache)
        cache.select(prefix.group)  # (G, ...) -> (U, ...)
        attention_mask = torch.cat([prefix.attention_mask[prefix.group], attention_mask], dim=1)  # (U, T_prompt)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (U, T_prompt)
    logits = decoder.forward(input_ids, positions[:, cache.used :], attention_mask, cache)  # (U, V)
    return logits, cache, attention_mask, positions


@torch.no_grad()
def sample_fast(decoder, input_ids, attention_mask, seeds, params: SamplingParams,
                stop_ids: list[int], pad_id: int, rows=None, desc: str = "", progress: bool = False,
                prefix: "SharedPrefix | None" = None):
    """:func:`sample_batch` on an :class:`agonlib.decode.FastDecoder`: same arguments, same draws.

    With ``prefix`` (see :func:`share_prefixes`), ``input_ids``/``attention_mask``
    hold only each prompt's suffix: the shared prefixes are prefilled first, once
    per group, and their KV cache copied to the group's prompts.

    Finished rows keep decoding (their tokens are ignored) until a quarter of
    the batch has finished; then they leave it in one copy of the KV cache,
    instead of one copy per finished row.
    """
    device = input_ids.device
    B = len(seeds)
    rows = torch.arange(B, device=device) if rows is None else torch.as_tensor(rows, device=device)
    generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    stops = torch.tensor(stop_ids, device=device)
    logits, cache, attention_mask, positions = prefill(decoder, input_ids, attention_mask, params.max_new_tokens,
                                                       prefix)
    width = attention_mask.shape[1]
    logits = logits[rows]  # (B, V)
    cache.select(rows)  # (U, ...) -> (B, ...)
    key_mask = torch.cat([attention_mask[rows], attention_mask.new_zeros(B, params.max_new_tokens)], dim=1)
    position = positions[rows, -1:]  # (B, 1)
    tokens = torch.full((B, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    live = torch.arange(B, device=device)  # the completion each batch row belongs to
    running = torch.ones(B, dtype=torch.bool, device=device)
    steps = 0
    for t in tqdm(range(params.max_new_tokens), desc=desc or "generate", leave=False, disable=not progress):
        idx = running.nonzero().squeeze(1)
        token = draw(logits[idx], params, [generators[i] for i in live[idx].tolist()])  # (b_running,)
        tokens[live[idx], t] = token
        steps = t + 1
        running[idx[torch.isin(token, stops)]] = False
        if not running.any() or t + 1 == params.max_new_tokens:
            break
        next_ids = torch.full((len(live), 1), pad_id, dtype=torch.long, device=device)
        next_ids[idx, 0] = token
        finished = len(live) - int(running.sum())
        if finished and 4 * finished >= len(live):
            keep = running.nonzero().squeeze(1)
            cache.select(keep)
            live, running, next_ids, key_mask, position = live[keep], running[keep], next_ids[keep], key_mask[keep], position[keep]
        key_mask[:, width + t] = 1
        position = position + 1
        logits = decoder.forward(next_ids, position, key_mask, cache)
    return tokens[:, :steps]  # (B, T_new)


def _cut_left(ids: list[list[int]], max_len: int, stats: GenerationStats | None = None) -> list[list[int]]:
    """Prompts longer than ``max_len`` tokens keep their end; each cut is logged and counted."""
    cut = sum(len(x) > max_len for x in ids)
    if cut:
        log.warning("%d prompt(s) longer than max_prompt_tokens=%d were cut from the left.", cut, max_len)
        if stats is not None:
            stats.prompts_truncated += cut
    return [x[-max_len:] for x in ids]


def _left_padded(ids: list[list[int]], max_len: int, pad_id: int, device, stats=None) -> dict:
    """Left-pad token lists into ``input_ids`` / ``attention_mask`` ``(U, T)``; over-long ones keep their end."""
    ids = _cut_left(ids, max_len, stats)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


@dataclass
class SharedPrefix:
    """Token prefixes that groups of prompts share, for :func:`sample_fast` to prefill once per group."""

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


MIN_SHARED = 16  # tokens: a shorter common prefix is not worth a prefill call of its own


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


def prompt_layout(ids: list[list[int]], pad_id: int, device) -> tuple[dict, SharedPrefix | None]:
    """Left-padded prompts for :func:`sample_fast`, split into shared prefixes and suffixes where that saves work.

    Returns ``(suffixes, prefix)``: without any shared prefix, ``suffixes`` are
    the whole prompts and ``prefix`` is ``None``.
    """
    group, lengths = share_prefixes(ids)
    if len(lengths) == len(ids):
        return _left_padded(ids, max(map(len, ids)), pad_id, device), None
    heads = [ids[group.index(g)][:n] for g, n in enumerate(lengths)]
    tails = [x[lengths[g]:] for x, g in zip(ids, group)]
    shared = _left_padded(heads, max(lengths), pad_id, device)
    prefix = SharedPrefix(shared["input_ids"], shared["attention_mask"], torch.tensor(group, device=device))
    return _left_padded(tails, max(map(len, tails)), pad_id, device), prefix


def fast_decoder(policies, adapter: str | None):
    """A :class:`agonlib.decode.FastDecoder` for ``adapter``, or ``None`` where the config or model rules it out."""
    from . import decode

    if adapter is not None and adapter not in getattr(policies.model, "peft_config", {adapter: None}):
        raise ValueError(f"No adapter {adapter!r}; adapters are {', '.join(policies.model.peft_config)} (or None for the base).")
    choice = policies.config.decoder
    usable = getattr(policies, "backend", None) == "transformers" and decode.supports(policies.model)
    if choice == "fast" and not usable:
        raise ValueError(f"decoder=fast needs a transformers-backend Llama or Qwen3 model; "
                         f"this is a {policies.backend} {policies.model.config.model_type!r}. Use decoder=auto.")
    if choice == "transformers" or not usable:
        return None
    return decode.FastDecoder(policies.model, adapter)


def generate(policies, prompts: list[str], adapter: str | None, seeds: list[int],
             params: SamplingParams | None = None, *, batch_size: int = 64, thinking: bool | None = None,
             task: str | None = None, max_prompt_tokens: int | None = None, desc: str = "",
             progress: bool = True, stats: GenerationStats | None = None) -> list[Rollout]:
    """One completion per (prompt, seed) under ``adapter`` (``None`` = the frozen base).

    ``prompts`` are rendered chat prompts (see :func:`agonlib.prompts.render`);
    repeat a prompt with different seeds for ``N`` generations.
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: give one seed per completion.")
    config, tok = policies.config, policies.tokenizer
    params = params or SamplingParams.from_config(config)
    thinking = config.thinking if thinking is None else thinking
    task = task or config.task
    max_prompt_tokens = max_prompt_tokens or config.max_prompt_tokens
    start = time.perf_counter()
    decoder = fast_decoder(policies, adapter)
    rollouts: list[Rollout] = []
    bar = tqdm(total=len(prompts), desc=desc or f"generate ({adapter or 'base'})", disable=not progress, leave=False)
    for lo in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[lo : lo + batch_size], seeds[lo : lo + batch_size]
        position = {p: i for i, p in enumerate(dict.fromkeys(chunk))}  # each distinct prompt prefilled once
        rows = [position[p] for p in chunk]
        ids = _cut_left(tok(list(position), add_special_tokens=False)["input_ids"], max_prompt_tokens, stats)
        if decoder is not None:
            enc, prefix = prompt_layout(ids, tok.pad_token_id, policies.device)
            new = sample_fast(decoder, enc["input_ids"], enc["attention_mask"], chunk_seeds, params,
                              policies.stop_token_ids, tok.pad_token_id, rows=rows, prefix=prefix)
        else:
            enc = _left_padded(ids, max_prompt_tokens, tok.pad_token_id, policies.device)
            with policies.use(adapter):
                new = sample_batch(policies.model, enc["input_ids"], enc["attention_mask"], chunk_seeds, params,
                                   policies.stop_token_ids, tok.pad_token_id, rows=rows)
        stop_set = set(policies.stop_token_ids)
        for i, (prompt, seed) in enumerate(zip(chunk, chunk_seeds)):
            drawn = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(drawn) if t in stop_set), None)
            completion = drawn[:end] if end else drawn
            text = tok.decode(completion, skip_special_tokens=True)
            parts = split_completion(text, thinking=thinking, task=task)
            rollouts.append(Rollout(prompt, ids[rows[i]], completion, text, parts.think, parts.summary,
                                    parts.answer, len(completion), end is None, int(seed)))
            if stats is not None:
                stats.tokens += len(completion)
        if stats is not None:
            stats.decode_steps += new.shape[1]
        bar.update(len(chunk))
    bar.close()
    if stats is not None:
        stats.seconds += time.perf_counter() - start
    return rollouts
