"""Grading throughput: the math worker pool against grading one at a time.

Run from the repo root::

    python -m benchmarks.grading            # 200 completions, writes benchmarks/grading.json
    python -m benchmarks.grading --n 40     # quicker

Side by side, on the same ~200 synthetic completions (50 problems x 4 samples,
as a GRPO step grades them; a quarter wrong, a few without a box):

- ``in-process``: ``score_math`` in a loop in this process: no sandbox, no
  timeout; what grading costs without any protection;
- ``grade_math, one call each``: the public single-call API in a loop (one
  worker busy at a time, plus a round trip per call);
- ``pool, k workers``: ``grade_math_batch(..., workers=k)``;
- ``control``: ``k`` plain processes each scoring a slice, no pool at all: what
  this machine allows in parallel, to tell pool overhead from CPU contention.

Each pool mode starts from a fresh pool whose workers are forked before the
clock starts, so no mode inherits another's caches. It also times the code
sandbox on a trivial program (runs per second, i.e. its per-test overhead).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import random
import time
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path

from agonlib.grading import code_grader as sandbox, math_grader as verify

OUT = Path(__file__).with_name("grading.json")


def synthetic(n: int, seed: int = 0) -> tuple[list[str], list[str], list[int]]:
    """``n`` completions (4 per problem), their golds, and the expected grades."""
    rng = random.Random(seed)
    completions, golds, expected = [], [], []
    for p in range((n + 3) // 4):
        a, b = rng.randint(1, 99), rng.randint(2, 40)
        kind = p % 5
        if kind == 0:  # integer
            gold, right, wrong = str(a * b), [str(a * b), f"{a * b}.0"], str(a * b + 1)
        elif kind == 1:  # fraction vs decimal
            gold = f"\\frac{{{a}}}{{{b * 4}}}"
            right, wrong = [f"{a / (b * 4):.10g}", f"{a}/{b * 4}"], f"\\frac{{{a + 1}}}{{{b * 4}}}"
        elif kind == 2:  # surd
            gold, wrong = f"{a}\\sqrt{{2}}", f"{a}\\sqrt{{3}}"
            right = [f"\\sqrt{{{2 * a * a}}}", f"{a}\\sqrt{{2}}"]
        elif kind == 3:  # interval
            gold, right, wrong = f"[{a}, {a + b})", [f"[{a},{a + b})"], f"({a}, {a + b})"
        else:  # set
            c = a + b  # distinct from a, so {a} is wrong
            gold, right, wrong = f"\\{{{a}, {c}\\}}", [f"\\{{{c},{a}\\}}"], f"\\{{{a}\\}}"
        for s in range(4):
            roll = rng.random()
            if roll < 0.05:
                text, ok = "I could not finish.", 0
            elif roll < 0.30:
                text, ok = f"Thus $\\boxed{{{wrong}}}$.", 0
            else:
                text, ok = f"Thus $\\boxed{{{rng.choice(right)}}}$.", 1
            completions.append(f"<think>step {s} of problem {p}...</think> {text}")
            golds.append(gold)
            expected.append(ok)
    return completions[:n], golds[:n], expected[:n]


def timed(fn) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _warm_scorer() -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify.score_math("\\boxed{\\frac{1}{2}}", "0.5")


def _score_slice(args: tuple[list[str], list[str]]) -> list[int]:
    return [verify.score_math(c, g) for c, g in zip(*args)]


def independent_processes(k: int, completions: list[str], golds: list[str]):
    """The machine's ceiling: ``k`` plain processes scoring interleaved slices, no pool."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(k, mp_context=ctx, initializer=_warm_scorer) as ex:
        list(ex.map(time.sleep, [0.5] * k))  # every process started and warm
        slices = [(completions[i::k], golds[i::k]) for i in range(k)]
        parts, seconds = timed(lambda: list(ex.map(_score_slice, slices)))
    scores = [0] * len(completions)
    for i, part in enumerate(parts):
        scores[i::k] = part
    return scores, seconds


def fresh_pool(workers: int) -> None:
    verify.shutdown()
    verify.grade_math_batch(["\\boxed{1}"] * workers, ["1"] * workers, thinking=False,
                            workers=workers)  # zygote up, workers forked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="completions to grade")
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="pool sizes to time (default: 1, 2 and the CPU count if larger)")
    ap.add_argument("--code-runs", type=int, default=20, help="sandboxed runs to time")
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    sizes = args.workers or sorted({1, 2, cpus})
    completions, golds, expected = synthetic(args.n)

    rows = []

    def record(mode: str, workers: int | None, scores: list[int], seconds: float) -> None:
        rows.append({"mode": mode, "workers": workers, "n": len(scores),
                     "seconds": round(seconds, 3), "per_second": round(len(scores) / seconds, 1),
                     "agrees_with_expected": scores == expected})

    load_start = os.getloadavg()[0]
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": on purpose
    verify.score_math("\\boxed{\\frac{1}{2}}", "0.5")  # warm, as the pool's zygote is
    scores, s = timed(lambda: [verify.score_math(c, g) for c, g in zip(completions, golds)])
    record("in-process (unsandboxed)", None, scores, s)
    fresh_pool(1)
    scores, s = timed(lambda: [verify.grade_math(c, g) for c, g in zip(completions, golds)])
    record("grade_math, one call each", 1, scores, s)
    for k in sizes:
        fresh_pool(k)
        scores, s = timed(lambda: verify.grade_math_batch(completions, golds, workers=k))
        record("pool (grade_math_batch)", k, scores, s)
    verify.shutdown()
    for k in sizes:
        if k > 1:
            scores, s = independent_processes(k, completions, golds)
            record("control: independent processes, no pool", k, scores, s)

    code = "```python\nprint(sum(map(int, input().split())))\n```"
    tests = [{"input": "1 2\n", "output": "3"}]
    sandbox.protections()
    ok, s = timed(lambda: [sandbox.grade_code(code, tests) for _ in range(args.code_runs)])
    code_row = {"runs": args.code_runs, "seconds": round(s, 3),
                "per_second": round(args.code_runs / s, 1), "all_passed": all(ok),
                "protection_level": sandbox.PROTECTIONS.get("level")}

    result = {
        "benchmark": "math grading throughput (completions graded per second)",
        "n_completions": len(completions), "cpu_count": cpus,
        "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "python": platform.python_version(), "math_verify": version("math-verify"),
        "math": rows, "code_sandbox": code_row,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")

    print(f"| mode | workers | completions/s | seconds | grades agree |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['workers'] or '-'} | {r['per_second']} | {r['seconds']} "
              f"| {r['agrees_with_expected']} |")
    print(f"| code sandbox, trivial program ({code_row['protection_level']}) | - | "
          f"{code_row['per_second']} runs/s | {code_row['seconds']} | {code_row['all_passed']} |")
    print(f"\n{len(completions)} completions, {cpus} CPUs, 1-min load average "
          f"{result['load_avg_1m']['start']} -> {result['load_avg_1m']['end']}; written to {OUT}")


if __name__ == "__main__":
    main()
