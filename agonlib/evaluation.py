"""Evaluation: pass@1 / pass@k of every system on held-out problems (DESIGN.md §2 "Inference", §6).

Systems, each on the same problems and the same sampling settings:

* ``base`` — the frozen base model (adapters disabled);
* ``A``, ``B`` — one adapter alone (``grpo``: adapter ``A`` of a vanilla GRPO run);
* ``cascade_AB``, ``cascade_BA`` — the paper's deployment mode: the first
  adapter drafts one solution, the second reads its summary (the same
  :func:`agonlib.parsing.extract_summary` the trainer uses) and its answer counts;
* ``moa`` — the untrained Mixture-of-Agents baseline: ``K`` base-model
  proposals, then a base-model aggregator that reads their final texts (final
  answers included, thinking left out) and answers;
* the cascade's controls (DESIGN.md §2): ``cascade_GG`` — a GRPO run's adapter
  drafts and then challenges its own summary (equal inference to ``A→B``);
  ``cascade_base`` — the untrained base in both stages; ``placebo_AB`` — ``A→B``
  with the summary replaced by :data:`agonlib.prompts.PLACEBO_SUMMARY`'s words,
  as many as the summary has (the prompt without the information).

The cascade always uses the challenge prompt (exchange), framed by the run's
``reward`` (rival or teammate) — also for a run trained without exchange, whose
challenger never saw that prompt in training. Its second stage has the
challenger's token cap (``challenger_max_new_tokens``).

Pairing (DESIGN.md §8): every system draws a problem's sample from the same
seed (the system's name is not part of it), so ``base`` and an untrained ``A``
give the same completion; the cascade ``A→B`` reuses ``A``'s own sample as its
first stage. Each pass@1 carries a Wilson 95% interval, paired comparisons
(cascade vs its first adapter, adapters vs base) the per-item transitions and
an exact McNemar p-value; ``A_B_disagreement`` is measured on greedy answers.

pass@1 is the mean correctness over ``n`` samples per problem; pass@k is the
unbiased estimator ``1 − C(n−c, k) / C(n, k)``. "Final-stage length" is the
token count of the completion whose answer counts (the challenger's in a
cascade, the aggregator's in MoA); ``tokens_per_problem`` counts every stage.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
from pathlib import Path

from . import prompts
from .agon import grade
from .config import EVAL_SYSTEMS, RUNS_DIR, Config
from .data import problems_for
from .generation import SamplingParams, generate, sample_seed
from .models import load_policies
from .parsing import final_text
from .runs import latest_adapters, load_run_config

log = logging.getLogger(__name__)

SYSTEMS = EVAL_SYSTEMS
_ADAPTER = {"base": None, "A": "A", "B": "B", "grpo": "A"}
#: Two-stage systems: (drafter, challenger) adapters, ``None`` the base; a GRPO run's adapter is ``A``.
CASCADES = {"cascade_AB": ("A", "B"), "cascade_BA": ("B", "A"), "cascade_GG": ("A", "A"),
            "cascade_base": (None, None), "placebo_AB": ("A", "B")}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples: ``1 − C(n−c, k) / C(n, k)``.

    >>> round(pass_at_k(5, 2, 1), 3), round(pass_at_k(5, 2, 2), 3), pass_at_k(5, 2, 4)
    (0.4, 0.7, 1.0)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def default_systems(config) -> tuple[str, ...]:
    if config.mode == "grpo":
        return ("base", "grpo")
    return ("base", "A", "B", "cascade_AB", "cascade_BA", "moa")


def _render(policies, config, messages):
    return prompts.render(policies.tokenizer, messages, config.thinking)


# --- intervals and paired tests (DESIGN.md §8) ---------------------------------------------

#: t_{0.975, df} for df = 1..30 (two-sided 95%); beyond 30, ``t975``'s expansion.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom.

    The table to 30; beyond it the Cornish–Fisher expansion of t around the normal quantile in powers of
    ``1/df`` (four terms: within 1e-5 of the exact quantile from df = 31 on).

    >>> t975(4), round(t975(60), 3), round(t975(10**6), 3)
    (2.776, 2.0, 1.96)
    """
    if df < 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
             (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(term / df ** (i + 1) for i, term in enumerate(terms))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson 95% interval of a proportion: honest at small ``n`` and near 0 or 1.

    >>> [round(v, 3) for v in wilson(3, 20)]
    [0.052, 0.36]
    """
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean over seeds with a 95% t-interval (NaN bounds for one seed).

    >>> [round(v, 3) for v in mean_interval([0.2, 0.3, 0.4])]
    [0.3, 0.052, 0.548]
    """
    values = [float(v) for v in values if v is not None and v == v]
    if not values:
        return (float("nan"),) * 3
    mean = statistics.fmean(values)
    if len(values) < 2:
        return (mean, float("nan"), float("nan"))
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return (mean, mean - half, mean + half)


def mcnemar_exact(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of the discordant pairs against 1/2.

    >>> round(mcnemar_exact(7, 0), 4), mcnemar_exact(3, 3)
    (0.0156, 1.0)
    """
    n, k = fixed + broken, min(fixed, broken)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(first: list, second: list, samples: int = 1) -> dict:
    """Per-problem transitions from ``first`` to ``second`` (0/1 lists over the same items and seeds).

    ``fixed``: wrong in ``first``, right in ``second``; ``broken``: the reverse; with the exact
    McNemar p-value of the difference. The items are ``samples`` consecutive samples per problem;
    a problem's samples are not independent, so the test reads each problem's first sample
    (as :mod:`agonlib.study.verdict` does) and ``n`` counts problems.

    >>> paired([0, 0, 1, 1], [1, 1, 1, 0], samples=2)  # problem 0 fixed (twice over), problem 1 unchanged
    {'n': 2, 'fixed': 1, 'broken': 0, 'p_value': 1.0}
    """
    if len(first) != len(second) or len(first) % samples:
        raise ValueError(f"paired comparison needs the same items, {samples} per problem: "
                         f"{len(first)} vs {len(second)}.")
    first, second = first[::samples], second[::samples]
    fixed = sum(1 for a, b in zip(first, second) if not a and b)
    broken = sum(1 for a, b in zip(first, second) if a and not b)
    return {"n": len(first), "fixed": fixed, "broken": broken, "p_value": mcnemar_exact(fixed, broken)}


# --- systems ------------------------------------------------------------------------------------

def _seeds(seed: int, n_problems: int, samples: int, stage: str) -> list[int]:
    """One seed per (problem, sample) of an evaluation stage. The system's name is not part of it, so
    every system draws its ``solve`` sample of a problem from the same seed (paired comparisons)."""
    return [sample_seed(seed, -1, i // samples, i % samples, f"eval/{stage}") for i in range(n_problems * samples)]


def run_system(policies, problems: list[dict], system: str, config, *, samples: int = 1, seed: int = 0,
               progress: bool = False, backend=None, solo: dict | None = None) -> dict:
    """One system on ``problems`` with ``samples`` completions each; per-problem results.

    ``backend`` samples the completions (``agonlib.backends``; default: the
    transformers path). ``solo`` caches each adapter's own one-stage samples
    (``{adapter: rollouts}``): the first stage of the cascade ``A→B`` *is*
    ``A``'s sample of the same problem, so ``A`` and ``A→B`` are paired.
    """
    if system not in SYSTEMS:
        raise ValueError(f"Unknown system {system!r}; systems are {', '.join(SYSTEMS)}.")
    gen = backend.generate if backend is not None else functools.partial(generate, policies)
    task = config.task
    solo = {} if solo is None else solo
    n_items = len(problems) * samples
    paired_problems = [problems[i // samples] for i in range(n_items)]
    seeds = functools.partial(_seeds, seed, len(problems), samples)
    opts = dict(params=SamplingParams.from_config(config), thinking=config.thinking, task=task,
                max_prompt_tokens=config.max_prompt_tokens, progress=progress)
    draft_text = [_render(policies, config, prompts.draft_prompt(p["question"], task)) for p in paired_problems]

    def single(adapter):
        if adapter not in solo:
            solo[adapter] = gen(draft_text, adapter, seeds("solve"), desc=f"eval {adapter or 'base'}", **opts)
        return solo[adapter]

    spent = [0] * n_items
    if system in _ADAPTER:
        final = single(_ADAPTER[system])
    elif system in CASCADES:
        first, second = CASCADES[system]
        drafts = single(first)
        spent = [d.length for d in drafts]
        summaries = [prompts.challenge_summary(d.summary, p["question"], config)
                     for p, d in zip(paired_problems, drafts)]
        if system.startswith("placebo_"):
            summaries = [prompts.placebo_summary(s) for s in summaries]
        challenge_text, _ = prompts.challenge_texts(policies.tokenizer, [p["question"] for p in paired_problems],
                                                    summaries, config.reward, task, config.thinking,
                                                    config.max_prompt_tokens)
        final = gen(challenge_text, second, seeds("second"), desc=f"eval {system}",
                    **{**opts, "params": SamplingParams.from_config(config, role="challenger")})
    else:  # moa: K base proposals (the first is the base's own sample), one base aggregator
        K = config.moa_k
        proposals = [single(None)] + [gen(draft_text, None, seeds(f"proposal{k}"), desc=f"eval moa {k + 1}/{K}",
                                          **opts) for k in range(1, K)]
        spent = [sum(p[i].length for p in proposals) for i in range(n_items)]
        # Each proposal's final text (its answer included), not its thinking: K traces would not fit.
        agg_text = [_render(policies, config, prompts.moa_prompt(
                        q["question"], [final_text(p[i].text, config.thinking) or "" for p in proposals], task))
                    for i, q in enumerate(paired_problems)]
        final = gen(agg_text, None, seeds("aggregate"), desc="eval moa aggregate", **opts)
    correct = grade(final, paired_problems, config)
    per_problem = [correct[p * samples : (p + 1) * samples] for p in range(len(problems))]
    return {
        "correct": per_problem,
        "answers": [r.answer for r in final],
        "final_lens": [r.length for r in final],
        "total_tokens": [s + r.length for s, r in zip(spent, final)],
    }


def summarize(result: dict, pass_k=(1,)) -> dict:
    """pass@1 with its Wilson 95% interval, pass@k, lengths and token spend of one system's results.

    The problems are the trials of the Wilson interval: a problem's samples are not independent,
    so with several samples a problem counts the mean of its samples as its success (exact for
    one sample per problem, conservative for more).
    """
    n = len(result["correct"][0]) if result["correct"] else 0
    items = [c for per_problem in result["correct"] for c in per_problem]
    out = {"pass@1": statistics.fmean(statistics.fmean(c) for c in result["correct"]) if n else float("nan")}
    out["pass@1_ci"] = list(wilson(sum(statistics.fmean(c) for c in result["correct"]), len(result["correct"])))
    for k in pass_k:
        if 1 < k <= n:
            out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, sum(c), k) for c in result["correct"])
    lens = result["final_lens"]
    out.update({
        "mean_final_len": statistics.fmean(lens) if lens else float("nan"),
        "median_final_len": statistics.median(lens) if lens else float("nan"),
        "tokens_per_problem": sum(result["total_tokens"]) / max(1, len(result["correct"])),
        "n_problems": len(result["correct"]),
        "n_samples": n,
        "correct": items,  # per (problem, sample), in order: what paired comparisons read
    })
    return out


def disagreement(answers_a: list, answers_b: list) -> float:
    """How often two systems give different final answers on the same items."""
    pairs = list(zip(answers_a, answers_b))
    return statistics.fmean(a != b for a, b in pairs) if pairs else float("nan")


#: Paired comparisons made whenever both systems are evaluated: (second, first) — does the second fix the first?
COMPARISONS = (("cascade_AB", "A"), ("cascade_BA", "B"), ("A", "base"), ("B", "base"), ("grpo", "base"),
               ("cascade_GG", "grpo"), ("cascade_base", "base"), ("cascade_AB", "placebo_AB"))


def greedy_disagreement(policies, problems: list[dict], config, backend=None) -> float:
    """How often ``A`` and ``B`` give different answers when both decode greedily (no sampling noise)."""
    gen = backend.generate if backend is not None else functools.partial(generate, policies)
    text = [_render(policies, config, prompts.draft_prompt(p["question"], config.task)) for p in problems]
    params = SamplingParams.from_config(config).greedy()
    seeds = _seeds(config.seed, len(problems), 1, "greedy")  # unused by greedy decoding, required by the API
    answers = {a: [r.answer for r in gen(text, a, seeds, params=params, thinking=config.thinking, task=config.task,
                                          max_prompt_tokens=config.max_prompt_tokens, progress=False)]
               for a in ("A", "B")}
    return disagreement(answers["A"], answers["B"])


def evaluate_policies(policies, problems: list[dict], config, systems=None, *, samples: int | None = None,
                      progress: bool = True, backend=None) -> dict:
    """Every system on ``problems``; returns ``{system: summary}``, ``comparisons`` and ``A_B_disagreement``.

    Every system uses the same per-problem seeds and each cascade reuses its
    first adapter's own samples, so ``comparisons`` are paired (exact McNemar).
    ``A_B_disagreement`` is measured on greedy answers when both adapters are evaluated.
    """
    systems = tuple(systems or default_systems(config))
    samples = samples or config.eval_samples
    solo: dict = {}
    raw = {s: run_system(policies, problems, s, config, samples=samples, seed=config.seed, progress=progress,
                         backend=backend, solo=solo) for s in systems}
    out = {s: summarize(r, config.pass_k) for s, r in raw.items()}
    levels = [p.get("difficulty") for p in problems]
    for s, r in raw.items():
        out[s]["final_len_distribution"] = r["final_lens"]
        if len(set(levels)) > 1:  # a mix of levels: pass@1 of each
            out[s]["pass@1_by_level"] = {str(level): statistics.fmean(
                statistics.fmean(c) for c, lv in zip(r["correct"], levels) if lv == level)
                for level in sorted(set(levels), key=str)}
    out["comparisons"] = {f"{second} vs {first}": paired(out[first]["correct"], out[second]["correct"], samples)
                          for second, first in COMPARISONS if first in out and second in out}
    if "A" in raw and "B" in raw:
        out["A_B_disagreement"] = greedy_disagreement(policies, problems, config, backend)
    return out


#: What a GRPO run (one adapter) can evaluate: its adapter, the base, and cascades of those alone.
ONE_ADAPTER_SYSTEMS = ("grpo", "base", "cascade_GG", "cascade_base")


def periodic_systems(config) -> tuple[str, ...]:
    """The periodic evaluation's systems: ``eval_systems``; a GRPO run's adapter and those it can run."""
    if config.mode != "grpo":
        return tuple(config.eval_systems)
    return ("grpo", *[s for s in config.eval_systems if s in ONE_ADAPTER_SYSTEMS and s != "grpo"])


def flat_row(result: dict, systems) -> dict:
    """An evaluation as one flat ``eval.jsonl`` row: ``<system>/pass@1`` (and per level), lengths, disagreement."""
    row = {f"{system}/{key}": result[system][key] for system in systems
           for key in ("pass@1", "mean_final_len", "tokens_per_problem")}
    row.update({f"{system}/pass@1_L{level}": value for system in systems
                for level, value in result[system].get("pass@1_by_level", {}).items()})
    row.update({key: result[key] for key in ("A_B_disagreement",) if key in result})
    return row


def evaluate(run_dir_or_config, systems=None, *, n_problems: int | None = None, samples: int | None = None,
             policies=None, progress: bool = True) -> dict:
    """Final evaluation of a run directory (its newest checkpoint) or of a config's untrained policies.

    A run directory's results go to its ``final_eval.json``; a config's (untrained
    adapters) to ``experiments/runs/<profile>/untrained/`` unless it names an
    ``out_dir``. Systems already in the file and not re-evaluated are kept when the file is of the
    same checkpoint; the evaluation of another checkpoint is replaced whole.
    """
    adapters = None
    if isinstance(run_dir_or_config, Config):
        config = run_dir_or_config
        run_dir = Path(config.out_dir) if config.out_dir else RUNS_DIR / config.profile / "untrained"
        policies = policies or load_policies(config)
    else:
        run_dir = Path(run_dir_or_config)
        config = load_run_config(run_dir)
        policies = policies or load_policies(config)
        adapters = latest_adapters(run_dir)
        if adapters is None:
            log.warning("%s has no complete checkpoint: evaluating untrained adapters.", run_dir)
        else:
            try:
                for name in ("A",) if config.mode == "grpo" else ("A", "B"):
                    policies.load_adapter(name, adapters)
            except RuntimeError as err:
                raise RuntimeError(f"The adapters in {adapters} do not fit {config.model}: "
                                   f"{str(err).splitlines()[0]}") from None
    problems = problems_for(config, "test")[: n_problems or config.final_eval_problems or None]
    found = evaluate_policies(policies, problems, config, systems, samples=samples, progress=progress)
    path = run_dir / "final_eval.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    checkpoint = str(adapters.parent) if adapters else None
    if result and (result.get("meta") or {}).get("checkpoint", checkpoint) != checkpoint:
        # Systems of another checkpoint must not sit beside these ones: a cascade would pair with another A.
        log.warning("%s held the evaluation of %s; it is replaced by that of %s.", path,
                    result["meta"]["checkpoint"], checkpoint)
        result = {}
    result.update({k: v for k, v in found.items() if k not in ("A_B_disagreement", "comparisons")})
    result["comparisons"] = {**result.get("comparisons", {}), **found["comparisons"]}
    result["meta"] = {"run": config.run_name, "profile": config.profile, "seed": config.seed,
                      "checkpoint": checkpoint,
                      "A_B_disagreement": found.get("A_B_disagreement", result.get("meta", {}).get("A_B_disagreement"))}
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result
