"""Sampling settings, per-completion seeds and the one-token sampler every agonlib engine uses.

Sampling follows ``transformers``' order of warpers: temperature, then top-k,
then top-p (nucleus), then one draw; temperature 0 is greedy. Every completion
has its own ``torch.Generator`` seeded from ``(seed, step, problem, sample)``
(:func:`sample_seed`), so a completion's draws do not depend on which other
prompts share its batch (its logits can, by float rounding: see
:mod:`agonlib.generation.loop`), and a resumed run replays the same draws.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


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


def token_entropy(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Entropy in nats of the distribution each row of ``(B, V)`` logits is sampled from (after
    :func:`warp_logits`); ``(B,)`` float64. Greedy decoding has none: zeros."""
    if params.temperature == 0:
        return torch.zeros(len(logits), dtype=torch.float64, device=logits.device)
    probs = warp_logits(logits.float(), params).softmax(-1)  # (B, V)
    return torch.special.entr(probs).sum(-1).double()  # entr(0) = 0: removed tokens add nothing


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
