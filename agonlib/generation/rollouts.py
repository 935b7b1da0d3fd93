"""Rollouts: one completion per (prompt, seed) under one adapter, parsed — what the trainer and evaluation call.

``generate(policies, prompts, adapter, seeds)`` tokenises each distinct prompt
once, cuts and pads them (:mod:`~agonlib.generation.layout`), runs agonlib's
decode loop on the engine the config picks (:func:`~agonlib.generation.engines.engine_for`)
and returns :class:`Rollout` records. :class:`Settings` resolves a call's
settings and turns drawn tokens into a Rollout — the same for every engine,
the vLLM backend's included (:mod:`agonlib.generation.backends`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..parsing import split_completion
from .engines import engine_for
from .layout import cut_left, distinct
from .loop import decode_batch
from .sampling import SamplingParams
from .stops import AnswerStop, answer_stop_for, complete

log = logging.getLogger(__name__)


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


@dataclass
class Settings:
    """One generate call's settings, from its arguments or else the config, and its Rollouts' parsing."""

    params: SamplingParams
    thinking: bool
    task: str
    max_prompt_tokens: int
    answer_stop: AnswerStop | None

    @classmethod
    def resolve(cls, policies, prompts, seeds, params=None, thinking=None, task=None, max_prompt_tokens=None,
                stop_at_answer=None) -> "Settings":
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: give one seed per completion.")
        config = policies.config
        thinking = config.thinking if thinking is None else thinking
        task = task or config.task
        return cls(params or SamplingParams.from_config(config), thinking, task,
                   max_prompt_tokens or config.max_prompt_tokens, answer_stop_for(policies, thinking, task, stop_at_answer))

    def rollout(self, tokenizer, prompt: str, prompt_ids: list[int], drawn: list[int], seed: int, stop_ids,
                extra: dict | None = None) -> Rollout:
        """The drawn tokens as a Rollout: trimmed at the first stop token or answer end, decoded, split."""
        completion, truncated = complete(drawn, stop_ids, self.answer_stop)
        text = tokenizer.decode(completion, skip_special_tokens=True)
        parts = split_completion(text, thinking=self.thinking, task=self.task)
        return Rollout(prompt, prompt_ids, completion, text, parts.think, parts.summary, parts.answer,
                       len(completion), truncated, int(seed), {} if extra is None else extra)


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

    Both engines hold a KV cache for every row of a batch up to
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
             desc: str = "", progress: bool = True, stats: GenerationStats | None = None,
             entropy: bool = False) -> list[Rollout]:
    """One completion per (prompt, seed) under ``adapter`` (``None`` = the frozen base).

    ``prompts`` are rendered chat prompts (see :func:`agonlib.prompts.render`);
    repeat a prompt with different seeds for ``N`` generations. ``stop_at_answer``
    (default: the config's, math tasks only) ends a completion at its first
    complete answer box (:mod:`agonlib.generation.stops`). ``entropy``: each Rollout's
    ``extra["entropy_sum"]`` is the summed entropy (nats) of the distributions its tokens were drawn from.
    """
    job = Settings.resolve(policies, prompts, seeds, params, thinking, task, max_prompt_tokens, stop_at_answer)
    tok, stop_ids = policies.tokenizer, policies.stop_token_ids
    batch_size = rows_that_fit(policies, job.max_prompt_tokens + job.params.max_new_tokens, batch_size)
    start = time.perf_counter()
    engine = engine_for(policies, adapter)
    rollouts: list[Rollout] = []
    bar = tqdm(total=len(prompts), desc=desc or f"generate ({adapter or 'base'})", disable=not progress, leave=False)
    for lo in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[lo : lo + batch_size], seeds[lo : lo + batch_size]
        unique, rows = distinct(chunk)  # each distinct prompt prefilled once
        ids = cut_left(tok(unique, add_special_tokens=False)["input_ids"], job.max_prompt_tokens, stats)
        sums = torch.zeros(len(chunk), dtype=torch.float64, device=policies.device) if entropy else None
        with engine.active():
            new = decode_batch(engine, ids, chunk_seeds, job.params, stop_ids, tok.pad_token_id, rows=rows,
                               answer_stop=job.answer_stop, entropy=sums)
        for i, (prompt, seed) in enumerate(zip(chunk, chunk_seeds)):
            extra = {"entropy_sum": float(sums[i])} if entropy else None
            rollouts.append(job.rollout(tok, prompt, ids[rows[i]], new[i].tolist(), seed, stop_ids, extra))
            if stats is not None:
                stats.tokens += rollouts[-1].length
        if stats is not None:
            stats.decode_steps += new.shape[1]
        bar.update(len(chunk))
    bar.close()
    if stats is not None:
        stats.seconds += time.perf_counter() - start
    return rollouts
