"""Evaluation: pass@1 / pass@k of every system on held-out problems (DESIGN.md §2 "Inference", §6).

Systems, each on the same problems and the same sampling settings:

* ``base`` — the frozen base model (adapters disabled);
* ``A``, ``B`` — one adapter alone (``grpo``: adapter ``A`` of a vanilla GRPO run);
* ``cascade_AB``, ``cascade_BA`` — the paper's deployment mode: the first
  adapter drafts one solution, the second reads its summary (the same
  :func:`agonlib.parsing.extract_summary` the trainer uses) and its answer counts;
* ``moa`` — the untrained Mixture-of-Agents baseline: ``K`` base-model
  proposals, then a base-model aggregator that reads their final texts (final
  answers included, thinking left out) and answers.

The cascade always uses the challenge prompt (exchange), framed by the run's
``reward`` (rival or teammate) — also for a run trained without exchange, whose
challenger never saw that prompt in training.

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
from .game import grade
from .parsing import final_text
from .rollouts import SamplingParams, generate, sample_seed

log = logging.getLogger(__name__)

SYSTEMS = ("base", "A", "B", "cascade_AB", "cascade_BA", "moa", "grpo")
_ADAPTER = {"base": None, "A": "A", "B": "B", "grpo": "A"}


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


def run_system(policies, problems: list[dict], system: str, config, *, samples: int = 1, seed: int = 0,
               progress: bool = False, backend=None) -> dict:
    """One system on ``problems`` with ``samples`` completions each; per-problem results.

    ``backend`` samples the completions (``agonlib.backends``; default: the transformers path).
    """
    if system not in SYSTEMS:
        raise ValueError(f"Unknown system {system!r}; systems are {', '.join(SYSTEMS)}.")
    gen = backend.generate if backend is not None else functools.partial(generate, policies)
    task = config.task
    n_items = len(problems) * samples
    paired = [problems[i // samples] for i in range(n_items)]
    seeds = lambda stage: [sample_seed(seed, -1, i // samples, i % samples, f"eval/{system}/{stage}")  # noqa: E731
                           for i in range(n_items)]
    opts = dict(params=SamplingParams.from_config(config), thinking=config.thinking, task=task,
                max_prompt_tokens=config.max_prompt_tokens, progress=progress)
    draft_text = [_render(policies, config, prompts.draft_prompt(p["question"], task)) for p in paired]
    spent = [0] * n_items
    if system in _ADAPTER:
        final = gen(draft_text, _ADAPTER[system], seeds("solve"), desc=f"eval {system}", **opts)
    elif system.startswith("cascade_"):
        first, second = system[-2], system[-1]
        drafts = gen(draft_text, first, seeds("draft"), desc=f"eval {system} draft", **opts)
        spent = [d.length for d in drafts]
        challenge_text = [_render(policies, config, prompts.challenge_prompt(p["question"], d.summary,
                                                                               config.reward, task))
                          for p, d in zip(paired, drafts)]
        final = gen(challenge_text, second, seeds("challenge"), desc=f"eval {system}", **opts)
    else:  # moa: K base proposals, one base aggregator
        K = config.moa_k
        proposals = [gen(draft_text, None, seeds(f"proposal{k}"), desc=f"eval moa {k + 1}/{K}",
                              **opts) for k in range(K)]
        spent = [sum(p[i].length for p in proposals) for i in range(n_items)]
        # Each proposal's final text (its answer included), not its thinking: K traces would not fit.
        agg_text = [_render(policies, config, prompts.moa_prompt(
                        q["question"], [final_text(p[i].text, config.thinking) or "" for p in proposals], task))
                    for i, q in enumerate(paired)]
        final = gen(agg_text, None, seeds("aggregate"), desc="eval moa aggregate", **opts)
    correct = grade(final, paired, config)
    per_problem = [correct[p * samples : (p + 1) * samples] for p in range(len(problems))]
    return {
        "correct": per_problem,
        "answers": [r.answer for r in final],
        "final_lens": [r.length for r in final],
        "total_tokens": [s + r.length for s, r in zip(spent, final)],
    }


def summarize(result: dict, pass_k=(1,)) -> dict:
    """pass@1, pass@k, lengths and token spend of one system's per-problem results."""
    n = len(result["correct"][0]) if result["correct"] else 0
    out = {"pass@1": statistics.fmean(statistics.fmean(c) for c in result["correct"]) if n else float("nan")}
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
    })
    return out


def disagreement(answers_a: list, answers_b: list) -> float:
    """How often two systems give different final answers on the same items."""
    pairs = list(zip(answers_a, answers_b))
    return statistics.fmean(a != b for a, b in pairs) if pairs else float("nan")


def evaluate_policies(policies, problems: list[dict], config, systems=None, *, samples: int | None = None,
                      progress: bool = True, backend=None) -> dict:
    """Every system on ``problems``; returns ``{system: summary}`` plus ``A_B_disagreement``."""
    systems = tuple(systems or default_systems(config))
    samples = samples or config.eval_samples
    raw = {s: run_system(policies, problems, s, config, samples=samples, seed=config.seed, progress=progress,
                         backend=backend) for s in systems}
    out = {s: summarize(r, config.pass_k) for s, r in raw.items()}
    for s, r in raw.items():
        out[s]["final_len_distribution"] = r["final_lens"]
    if "A" in raw and "B" in raw:
        out["A_B_disagreement"] = disagreement(raw["A"]["answers"], raw["B"]["answers"])
    return out


def _latest_adapters(run_dir: Path) -> Path | None:
    """The adapters of a run's newest complete checkpoint (``None`` without one)."""
    from .trainer import complete_checkpoints

    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] / "adapters" if ckpts else None


def load_run_config(run_dir: Path):
    """The config a run directory was trained with (its ``config.json``), with clear errors."""
    from .config import ConfigError, load_config

    saved = Path(run_dir) / "config.json"
    if not saved.exists():
        raise FileNotFoundError(f"{run_dir} has no config.json: is it a run directory?")
    try:
        values = dict(json.loads(saved.read_text())["config"])
        return load_config(values.pop("profile"), **values)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"{saved} is not a readable run config ({type(err).__name__}: {err}).") from None


def evaluate(run_dir_or_config, systems=None, *, n_problems: int | None = None, samples: int | None = None,
             policies=None, progress: bool = True) -> dict:
    """Final evaluation of a run directory (its newest checkpoint) or of a config's untrained policies.

    A run directory's results go to its ``final_eval.json``; a config's (untrained
    adapters) to ``experiments/runs/<profile>/untrained/`` unless it names an
    ``out_dir``. Systems already in the file and not re-evaluated are kept.
    """
    from .config import RUNS_DIR, Config
    from .data import problems_for
    from .models import load_policies

    adapters = None
    if isinstance(run_dir_or_config, Config):
        config = run_dir_or_config
        run_dir = Path(config.out_dir) if config.out_dir else RUNS_DIR / config.profile / "untrained"
        policies = policies or load_policies(config)
    else:
        run_dir = Path(run_dir_or_config)
        config = load_run_config(run_dir)
        policies = policies or load_policies(config)
        adapters = _latest_adapters(run_dir)
        if adapters is None:
            log.warning("%s has no complete checkpoint: evaluating untrained adapters.", run_dir)
        else:
            try:
                for name in ("A",) if config.mode == "grpo" else ("A", "B"):
                    policies.load_adapter(name, adapters)
            except RuntimeError as err:
                raise RuntimeError(f"The adapters in {adapters} do not fit {config.model}: "
                                   f"{str(err).splitlines()[0]}") from None
    problems = problems_for(config, "test")[: n_problems or config.eval_problems]
    found = evaluate_policies(policies, problems, config, systems, samples=samples, progress=progress)
    path = run_dir / "final_eval.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({k: v for k, v in found.items() if k != "A_B_disagreement"})
    result["meta"] = {"run": config.run_name, "profile": config.profile, "seed": config.seed,
                      "checkpoint": str(adapters.parent) if adapters else None,
                      "A_B_disagreement": found.get("A_B_disagreement", result.get("meta", {}).get("A_B_disagreement"))}
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result
