"""Batched sampling under one adapter, with a seed per completion.

``generate(policies, prompts, adapter, seeds)`` left-pads the prompts, prefills
them once and decodes with a KV cache. Every completion has its own
``torch.Generator`` seeded from ``(seed, step, problem, sample)`` (see
:func:`sample_seed`), so a completion does not depend on which other prompts
share its batch's random stream, and a resumed run replays the same draws.

Sampling follows ``transformers``' order of warpers: temperature, then top-k,
then top-p (nucleus), then one multinomial draw; temperature 0 is greedy.

Stop at the answer (``stop_at_answer``, math tasks): a completion ends at the
token that closes its first complete ``\\boxed{…}`` (with thinking: the first
complete box after ``</think>``), as if that token were a stop token. What
follows a finished answer is never graded, and on a small model it is mostly
a runaway tail that only costs tokens. The decode loops stop such a row early;
:func:`complete` trims every engine's output by the same rule.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from . import decode
from .parsing import final_text, last_boxed, split_completion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128

    @classmethod
    def from_config(cls, config, role: str = "drafter") -> "SamplingParams":
        """The config's sampling settings; ``role="challenger"`` takes the challenger's token cap."""
        cap = config.challenger_tokens if role == "challenger" else config.max_new_tokens
        return cls(config.temperature, config.top_p, config.top_k, cap)

    def greedy(self) -> "SamplingParams":
        """The same settings at temperature 0 (argmax decoding)."""
        return SamplingParams(0.0, self.top_p, self.top_k, self.max_new_tokens)


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


def has_answer(text: str, thinking: bool) -> bool:
    """Whether ``text`` already holds a complete answer: a closed box (after ``</think>`` when thinking)."""
    final = final_text(text, thinking)
    return final is not None and last_boxed(final) is not None


class AnswerStop:
    """Finds the token that completes a completion's first answer box (see the module docstring).

    Only a token whose text holds ``}`` can close a box, so the loops decode a
    row's tokens only when it draws one of those (``closing``).
    """

    def __init__(self, tokenizer, thinking: bool):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.closing = _closing_tokens(tokenizer)  # (V,), on the CPU: the rows it finds are decoded there anyway

    def reached(self, ids: list[int]) -> bool:
        return has_answer(self.tokenizer.decode(ids, skip_special_tokens=True), self.thinking)

    def finished_rows(self, rows: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Of the completions ``rows`` that drew ``token`` at step ``t``, those whose answer is now complete."""
        maybe = self.closing[token.cpu().clamp(max=len(self.closing) - 1)]  # (b,)
        done = torch.zeros_like(maybe)
        for k in maybe.nonzero().squeeze(1).tolist():
            done[k] = self.reached(tokens[rows[k], : t + 1].tolist())
        return done.to(token.device)

    def end(self, ids: list[int]) -> int | None:
        """The length of the shortest prefix of ``ids`` that holds a complete answer, or ``None``.

        Binary search: once a prefix holds a closed box, every longer one does.
        """
        if not self.reached(ids):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.reached(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo


@functools.lru_cache(maxsize=4)
def _closing_tokens(tokenizer) -> torch.Tensor:
    """``(V,)`` bool: the tokens whose text holds a ``}`` (one pass over the vocabulary per tokenizer)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([piece is not None and "}" in piece for piece in pieces], dtype=torch.bool)


def complete(drawn: list[int], stop_ids, answer_stop: AnswerStop | None = None) -> tuple[list[int], bool]:
    """``(completion, truncated)``: ``drawn`` up to and including its first stop token or answer end.

    A completion with neither is truncated (it ran into ``max_new_tokens``).
    """
    stop_set = set(stop_ids)
    end = next((j + 1 for j, t in enumerate(drawn) if t in stop_set), None)
    if answer_stop is not None:
        answered = answer_stop.end(drawn[:end] if end else drawn)
        if answered is not None and (end is None or answered < end):
            end = answered
    return (drawn[:end], False) if end else (list(drawn), True)


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
    the uniform. Temperature 0 is greedy (the first most likely token).
    """
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = warp_logits(logits.float(), params).softmax(-1)  # (B, V)
    cdf = probs.double().cumsum(-1)  # (B, V)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device) for g in generators])  # (B,)
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)  # (B,)
    return token.clamp_(max=logits.shape[-1] - 1)


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


@torch.no_grad()
def sample_batch(model, input_ids, attention_mask, seeds, params: SamplingParams,
                 stop_ids: list[int], pad_id: int, rows=None, desc: str = "", progress: bool = False,
                 answer_stop: AnswerStop | None = None):
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
    cache = select_cache_rows(out.past_key_values, rows)  # (U, ...) -> (B, ...)
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
        if answer_stop is not None:
            done |= answer_stop.finished_rows(live, token, tokens, t)
        if done.all() or t + 1 == params.max_new_tokens:
            break
        if done.any():  # drop finished rows from the batch and the cache
            keep = (~done).nonzero().squeeze(1)
            live, token, attention_mask, position = live[keep], token[keep], attention_mask[keep], position[keep]
            cache = select_cache_rows(cache, keep)
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
                prefix: "SharedPrefix | None" = None, answer_stop: AnswerStop | None = None):
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
        if answer_stop is not None:
            running[idx[answer_stop.finished_rows(live[idx], token, tokens, t)]] = False
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


def answer_stop_for(policies, thinking: bool, task: str, stop_at_answer: bool | None = None) -> AnswerStop | None:
    """The :class:`AnswerStop` for a generate call, or ``None`` where answers do not stop generation."""
    wanted = getattr(policies.config, "stop_at_answer", True) if stop_at_answer is None else stop_at_answer
    if not wanted or task != "math":
        return None
    return AnswerStop(policies.tokenizer, thinking)


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token takes: layers × (key + value) × kv heads × head dim × dtype size."""
    cfg = getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "config")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    size = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * size


#: Share of the free GPU memory a rollout batch's KV cache may take (activations and logits need the rest).
KV_MEMORY_SHARE = 0.5


def rows_that_fit(policies, sequence_length: int, requested: int) -> int:
    """Rollouts per batch whose KV cache fits the free GPU memory (``requested`` on a CPU).

    Both decode loops hold a KV cache for every row of a batch up to
    ``sequence_length`` (prompt plus ``max_new_tokens``): 32 rows of 5k tokens
    of Qwen3-0.6B are 17.5 GiB, more than a T4 has. On CUDA the batch is cut
    to what ``KV_MEMORY_SHARE`` of the free memory holds (at least one row).
    """
    if policies.device.type != "cuda":
        return requested
    free, _ = torch.cuda.mem_get_info(policies.device)
    per_row = kv_bytes_per_token(policies.model) * sequence_length
    fit = max(1, int(free * KV_MEMORY_SHARE // per_row))
    if fit < requested:
        log.info("Rollout batches of %d rows (not %d): the KV cache of %d tokens a row must fit %.1f GiB free.",
                 fit, requested, sequence_length, free / 2**30)
    return min(requested, fit)


def generate(policies, prompts: list[str], adapter: str | None, seeds: list[int],
             params: SamplingParams | None = None, *, batch_size: int = 64, thinking: bool | None = None,
             task: str | None = None, max_prompt_tokens: int | None = None, stop_at_answer: bool | None = None,
             desc: str = "", progress: bool = True, stats: GenerationStats | None = None) -> list[Rollout]:
    """One completion per (prompt, seed) under ``adapter`` (``None`` = the frozen base).

    ``prompts`` are rendered chat prompts (see :func:`agonlib.prompts.render`);
    repeat a prompt with different seeds for ``N`` generations. ``stop_at_answer``
    (default: the config's, math tasks only) ends a completion at its first
    complete answer box (module docstring).
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: give one seed per completion.")
    config, tok = policies.config, policies.tokenizer
    params = params or SamplingParams.from_config(config)
    thinking = config.thinking if thinking is None else thinking
    task = task or config.task
    max_prompt_tokens = max_prompt_tokens or config.max_prompt_tokens
    answer_stop = answer_stop_for(policies, thinking, task, stop_at_answer)
    batch_size = rows_that_fit(policies, max_prompt_tokens + params.max_new_tokens, batch_size)
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
                              policies.stop_token_ids, tok.pad_token_id, rows=rows, prefix=prefix,
                              answer_stop=answer_stop)
        else:
            enc = _left_padded(ids, max_prompt_tokens, tok.pad_token_id, policies.device)
            with policies.use(adapter):
                new = sample_batch(policies.model, enc["input_ids"], enc["attention_mask"], chunk_seeds, params,
                                   policies.stop_token_ids, tok.pad_token_id, rows=rows, answer_stop=answer_stop)
        for i, (prompt, seed) in enumerate(zip(chunk, chunk_seeds)):
            completion, truncated = complete(new[i].tolist(), policies.stop_token_ids, answer_stop)
            text = tok.decode(completion, skip_special_tokens=True)
            parts = split_completion(text, thinking=thinking, task=task)
            rollouts.append(Rollout(prompt, ids[rows[i]], completion, text, parts.think, parts.summary,
                                    parts.answer, len(completion), truncated, int(seed)))
            if stats is not None:
                stats.tokens += len(completion)
        if stats is not None:
            stats.decode_steps += new.shape[1]
        bar.update(len(chunk))
    bar.close()
    if stats is not None:
        stats.seconds += time.perf_counter() - start
    return rollouts
