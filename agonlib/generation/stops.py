"""Where a completion ends: its first stop token, or (math) the token that closes its first answer.

Stop at the answer (``stop_at_answer``, math tasks): a completion ends at the
token that closes its first complete ``\\boxed{…}`` (with thinking: the first
complete box after ``</think>``), as if that token were a stop token. What
follows a finished answer is never graded, and on a small model it is mostly
a runaway tail that only costs tokens. The decode loop stops such a row early
(:meth:`AnswerStop.finished_rows`); :func:`complete` trims every engine's
output — agonlib's own and vLLM's — by the same rule.
"""

from __future__ import annotations

import functools

import torch

from ..parsing import final_text, last_boxed


def has_answer(text: str, thinking: bool) -> bool:
    """Whether ``text`` already holds a complete answer: a closed box (after ``</think>`` when thinking)."""
    final = final_text(text, thinking)
    return final is not None and last_boxed(final) is not None


class AnswerStop:
    """Finds the token that completes a completion's first answer box (see the module docstring).

    Only a token whose text holds ``}`` can close a box, so the loop decodes a
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


def answer_stop_for(policies, thinking: bool, task: str, stop_at_answer: bool | None = None) -> AnswerStop | None:
    """The :class:`AnswerStop` for a generate call, or ``None`` where answers do not stop generation."""
    wanted = getattr(policies.config, "stop_at_answer", True) if stop_at_answer is None else stop_at_answer
    if not wanted or task != "math":
        return None
    return AnswerStop(policies.tokenizer, thinking)


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
