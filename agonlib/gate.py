"""The gate (DESIGN.md §8): can the untrained challenger use the challenge prompt at all?

``python -m agonlib gate --profile cpu`` plays ``gate_problems × num_generations``
draft/challenge pairs of the *untrained* adapters on held-out problems, with
fixed seeds: ``A`` drafts (as at step 1), ``B`` challenges each draft three
times — reading its summary framed as a rival's attempt (competitive), framed
as a teammate's (cooperative), and with the rival hidden (no exchange, the
drafter's own prompt). The three challenges of a pair share one seed, so the
conditions are paired. For drafts and each challenge condition it reports the
boxed rate, truncation rate and accuracy, and for the challenges conversion
(right where the draft was wrong) and regression (wrong where it was right)
over all pairs; for the summaries, the leak rate.

A challenge prompt that makes the challenger worse than no summary at all at
initialisation is a prompt bug, not a finding. The goals (``GOALS``): the
challenger boxes ≥ 80% of its answers and runs into its token cap ≤ 15% of the
time with exchange, and is at least as accurate with exchange as without, in
both framings. The result goes to ``experiments/gate/<profile>.json`` (float32;
``<profile>-<dtype>.json`` in another dtype: ``dtype: auto`` is bf16 on a CPU with
AMX) with a fingerprint of the prompts and settings it measured, so the
reproduction reruns the gate only when one of them changed (:func:`cached_gate`).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

from . import prompts
from .agon import grade
from .config import REPO_ROOT, Config
from .data import problems_for
from .generation import SamplingParams, generate, sample_seed
from .metrics import leaks
from .models import load_policies, resolved_dtype

GATE_DIR = REPO_ROOT / "experiments" / "gate"
CONDITIONS = ("competitive", "cooperative", "no_exchange")
GOALS = {"boxed_rate_min": 0.8, "truncation_max": 0.15}
#: The settings a gate result depends on: a change to any of them (or to a prompt) reruns it.
FINGERPRINT_KEYS = ("model", "dtype", "thinking", "task", "dataset", "levels", "min_difficulty", "test_size",
                    "seed", "temperature", "top_p", "top_k", "max_new_tokens", "challenger_max_new_tokens",
                    "max_prompt_tokens", "stop_at_answer", "num_generations", "gate_problems", "lora_r",
                    "lora_alpha", "lora_targets", "b_init_std", "tiny_hidden_size", "tiny_layers")


def fingerprint(config: Config) -> str:
    """A short hash of the prompts and the settings the gate measured.

    The dtype is the one this machine resolves ``dtype`` to: a gate measured in one does not stand for the other.
    """
    settings = {k: getattr(config, k) for k in FINGERPRINT_KEYS}
    settings["dtype"] = resolved_dtype(config)
    if config.summary_mask != "answer":  # only where set, so the gates measured before the key keep theirs
        settings["summary_mask"] = config.summary_mask
    blob = json.dumps({"prompts": prompts.all_prompts(), "settings": settings}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def _rates(rollouts, correct: list[int]) -> dict:
    return {"boxed_rate": statistics.fmean(r.answer is not None for r in rollouts),
            "truncation_rate": statistics.fmean(r.truncated for r in rollouts),
            "accuracy": statistics.fmean(correct),
            "len_mean": statistics.fmean(r.length for r in rollouts)}


def _pair_rates(c_draft: list[int], c_challenge: list[int]) -> dict:
    n = len(c_draft)
    return {"conversion_rate": sum(1 for a, b in zip(c_draft, c_challenge) if b and not a) / n,
            "regression_rate": sum(1 for a, b in zip(c_draft, c_challenge) if a and not b) / n}


def verdict(result: dict) -> list[str]:
    """The goals a gate result misses, one sentence each (empty: it passes)."""
    misses = []
    plain = result["no_exchange"]["accuracy"]
    for framing in ("competitive", "cooperative"):
        got = result[framing]
        if got["boxed_rate"] < GOALS["boxed_rate_min"]:
            misses.append(f"{framing}: the challenger boxes {got['boxed_rate']:.2f} of its answers "
                          f"(goal ≥ {GOALS['boxed_rate_min']}).")
        if got["truncation_rate"] > GOALS["truncation_max"]:
            misses.append(f"{framing}: {got['truncation_rate']:.2f} of challenges hit the token cap "
                          f"(goal ≤ {GOALS['truncation_max']}).")
        if got["accuracy"] < plain:
            misses.append(f"{framing}: accuracy with the summary {got['accuracy']:.3f} is below accuracy "
                          f"without it {plain:.3f}: the prompt hurts the challenger.")
    return misses


def run_gate(config: Config, policies=None, *, progress: bool = True, examples: int = 3) -> dict:
    """Play the gate's pairs and return its measurements (see the module docstring)."""
    start = time.perf_counter()
    policies = policies or load_policies(config)
    tok, task, thinking, G = policies.tokenizer, config.task, config.thinking, config.num_generations
    problems = problems_for(config, "test")[: config.gate_problems]
    paired = [problems[i // G] for i in range(len(problems) * G)]
    seeds = lambda role: [sample_seed(config.seed, 0, i // G, i % G, f"gate/{role}")  # noqa: E731
                          for i in range(len(paired))]
    opts = dict(thinking=thinking, task=task, max_prompt_tokens=config.max_prompt_tokens, progress=progress)
    render = lambda messages: prompts.render(tok, messages, thinking)  # noqa: E731
    draft_text = [render(prompts.draft_prompt(p["question"], task)) for p in paired]
    drafts = generate(policies, draft_text, "A", seeds("draft"), SamplingParams.from_config(config),
                      desc="gate: drafts (A)", **opts)
    c_draft = grade(drafts, paired, config)
    summaries = [prompts.challenge_summary(d.summary, p["question"], config) for d, p in zip(drafts, paired)]
    result = {"n_pairs": len(paired), "n_problems": len(problems), "drafts": _rates(drafts, c_draft),
              "leak_rate": statistics.fmean(leaks(s, p.get("answer"), p["question"])
                                            for s, p in zip(summaries, paired))}
    challenger = SamplingParams.from_config(config, role="challenger")
    samples = []
    for condition in CONDITIONS:
        text = draft_text if condition == "no_exchange" else prompts.challenge_texts(
            tok, [p["question"] for p in paired], summaries, condition, task, thinking, config.max_prompt_tokens)[0]
        challenges = generate(policies, text, "B", seeds("challenge"), challenger,
                              desc=f"gate: challenges, {condition} (B)", **opts)
        correct = grade(challenges, paired, config)
        result[condition] = {**_rates(challenges, correct), **_pair_rates(c_draft, correct)}
        samples += [{"condition": condition, "question": p["question"], "gold": p.get("answer"),
                     "draft": d.text, "summary": s, "challenge": c.text, "challenge_correct": k}
                    for p, d, s, c, k in list(zip(paired, drafts, summaries, challenges, correct))[:examples]]
    misses = verdict(result)
    return {**result, "passed": not misses, "misses": misses, "goals": GOALS,
            "challenger_max_new_tokens": config.challenger_tokens, "profile": config.profile,
            "fingerprint": fingerprint(config), "seconds": round(time.perf_counter() - start, 1),
            "prompts": prompts.all_prompts(), "examples": samples}


def gate_path(profile: str, root: str | Path | None = None, dtype: str = "float32") -> Path:
    """``<profile>.json`` for a gate measured in float32, ``<profile>-<dtype>.json`` in any other dtype."""
    return Path(root or GATE_DIR) / (f"{profile}.json" if dtype == "float32" else f"{profile}-{dtype}.json")


def write_gate(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return path


def cached_gate(config: Config, path: Path, *, progress: bool = True) -> tuple[dict, bool]:
    """``(result, rerun)``: the gate result at ``path`` if it measured these prompts and settings, else a new one."""
    if path.exists():
        try:
            found = json.loads(path.read_text())
        except json.JSONDecodeError:
            found = {}
        if found.get("fingerprint") == fingerprint(config):
            return found, False
    return json.loads(write_gate(run_gate(config, progress=progress), path).read_text()), True


def format_gate(result: dict) -> str:
    """The gate's table, readably."""
    head = f"{'':13s} {'boxed':>6s} {'trunc':>6s} {'acc':>6s} {'conv':>6s} {'regr':>6s} {'len':>6s}"
    lines = [f"Gate ({result['profile']}): {result['n_pairs']} draft/challenge pairs of the untrained adapters, "
             f"challenger cap {result['challenger_max_new_tokens']} tokens, summary leak rate "
             f"{result['leak_rate']:.3f}", head]
    for name in ("drafts", *CONDITIONS):
        r = result[name]
        conv = f"{r['conversion_rate']:6.3f} {r['regression_rate']:6.3f}" if "conversion_rate" in r else " " * 13
        lines.append(f"{name:13s} {r['boxed_rate']:6.3f} {r['truncation_rate']:6.3f} {r['accuracy']:6.3f} {conv} "
                     f"{r['len_mean']:6.1f}")
    lines.append("PASSED" if result["passed"] else "FAILED: " + " ".join(result["misses"]))
    return "\n".join(lines)
