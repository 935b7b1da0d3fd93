"""One forced training step in its own process, as the trainer runs it; prints one JSON line.

Run by ``benchmarks/run.py`` (sections ``step`` and ``rss``) as a script, with ``PYTHONPATH`` naming the
source tree to measure: this checkout, or a ``git worktree`` of an older commit, so that an old and a new
``agonlib`` run the same work side by side. It uses only names both trees have (``play_round``,
``update_role``, ``UpdateConfig``, ``SingleProcess``).

The step: ``problems_per_step`` problems of the ``cpu`` profile, every completion running to
``max_new_tokens`` (stop tokens off), rewards drawn at random so that every row has a non-zero advantage,
then one ``update_role`` per role, the trainer's own update (its forward passes, no others). Reported:
seconds (generation, update), forward passes of the model under the update (with and without gradients),
peak resident memory (``VmHWM``, this process only).

``--steps K`` runs K consecutive steps in the one process, each on the next ``problems_per_step`` problems with
the roles rotating, as a training run does. The first step of a process pays one-time costs (oneDNN's kernels
for new shapes, the allocator's first pages): 24 s against 19 s for the next ones on the AMX Xeon in bf16, and
52 s against 32–39 s at the baseline commit. The top-level keys are the first step's; ``warm`` averages the
later ones, the steps a run repeats (the one step itself when K is 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("agon", "grpo_2n"))
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the first step's index (rotates the roles)")
    parser.add_argument("--steps", type=int, default=1, help="consecutive steps in this process")
    parser.add_argument("--uncapped", action="store_true", help="without the profile's micro_batch_tokens")
    parser.add_argument("--micro-batch-tokens", type=int, help="instead of the profile's")
    parser.add_argument("--second-base", action="store_true", help="hold a second base model in private memory")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile every decoder layer (dynamic shapes): the update's forward and backward")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from agonlib import load_config
    from agonlib.data import problems_for
    from agonlib.grpo import UpdateConfig
    from agonlib.models import load_policies

    mode = {"mode": "agon"} if args.kind == "agon" else {"mode": "grpo", "grpo_compute_matched": True}
    cap = {"micro_batch_tokens": None} if args.uncapped else {}
    if args.micro_batch_tokens:
        cap = {"micro_batch_tokens": args.micro_batch_tokens}
    cfg = load_config("cpu", max_new_tokens=args.step_tokens, challenger_max_new_tokens=args.step_tokens,
                      device="cpu", **mode, **cap)
    policies = load_policies(cfg, adapters=("A", "B") if args.kind == "agon" else ("A",))
    if args.second_base:  # what two separate policy models would add: a second base in private pages
        second = load_policies(cfg, adapters=("A",))
        with torch.no_grad():
            for p in second.model.parameters():
                p.data = p.data.clone()
    if args.compile:
        compile_layers(policies.model)
    after_load = peak_rss_mib()
    fields = {f.name for f in dataclasses.fields(UpdateConfig)}
    update_cfg = UpdateConfig(**{k: v for k, v in dict(
        loss_type=cfg.loss_type, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, num_iterations=cfg.num_iterations,
        micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.micro_batch_tokens,
        max_grad_norm=cfg.max_grad_norm, share_prefix=True).items() if k in fields})

    policies.stop_token_ids = []  # every completion runs to max_new_tokens (or its first complete box)
    forwards = {"with_grad": 0, "no_grad": 0}
    policies.model.register_forward_pre_hook(
        lambda *_: forwards.__setitem__(k := "with_grad" if torch.is_grad_enabled() else "no_grad", forwards[k] + 1))
    P, train = cfg.problems_per_step, problems_for(cfg, "train")
    steps = []
    for i in range(args.steps):
        step = args.seed + i
        steps.append(one_step(policies, train[step * P: (step + 1) * P], step, cfg, update_cfg, forwards))
    first, later = steps[0], steps[1:] or steps
    warm = {key: round(sum(s[key] for s in later) / len(later), 2)
            for key in ("generation_s", "draft_generation_s", "challenge_generation_s", "update_s", "total_s")}
    print(json.dumps({
        "kind": args.kind, "uncapped": args.uncapped, "second_base": args.second_base, "compiled": args.compile, **first,
        "dtype": str(policies.dtype).removeprefix("torch."), "after_load_rss_mib": round(after_load, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1), "steps": steps, "warm": warm,
    }))


def compile_layers(model) -> None:
    """``torch.compile`` each decoder layer in place (dynamic shapes), a probe of the lever agonlib leaves out.

    It reaches the training forward and backward only: the rollouts' fast decoder calls the layers' norms and
    merged weights itself, not the layers. Each layer's index is a guard of the key/value cache, so every layer
    compiles its own graph: the recompile limits are raised to let all of them (and later shapes) compile rather
    than fall back to eager after the eighth.
    """
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in (m for m in inner.modules() if type(m).__name__.endswith("DecoderLayer")):
        layer.compile(dynamic=True)


def one_step(policies, problems, step, cfg, update_cfg, forwards) -> dict:
    """Draft (and challenge), then one ``update_role`` per role with random rewards; seconds, tokens, forwards."""
    from agonlib.agon import RewardParts, play_round, update_role
    from agonlib.distributed import SingleProcess

    start = time.perf_counter()
    rnd = play_round(policies, problems, step, cfg, progress=False)
    generation = time.perf_counter() - start
    generation_rss = peak_rss_mib()
    roles = [(rnd.drafter, rnd.drafts)] + ([(rnd.challenger, rnd.challenges)] if rnd.challenger else [])
    gen = torch.Generator().manual_seed(step)
    forwards.update(with_grad=0, no_grad=0)  # the update's forward passes only
    update = 0.0
    role_peaks = []  # peak RSS after each role's update
    for adapter, rollouts in roles:
        rewards = torch.randn(len(rollouts), generator=gen).tolist()  # non-zero advantages: every row trains
        parts = [RewardParts(correct=r, total=r) for r in rewards]
        optimizer = torch.optim.AdamW(policies.params(adapter), lr=cfg.learning_rate)
        start = time.perf_counter()
        update_role(policies, adapter, rollouts, parts, rnd.group_size, optimizer, update_cfg, cfg, SingleProcess())
        update += time.perf_counter() - start
        role_peaks.append(round(peak_rss_mib(), 1))
    rows = [r for _, rs in roles for r in rs]
    return {
        "step": step, "generation_s": round(generation, 2), "update_s": round(update, 2),
        "total_s": round(generation + update, 2), "draft_generation_s": round(rnd.draft_generation.seconds, 2),
        "challenge_generation_s": round(rnd.challenge_generation.seconds, 2),
        "sequences": len(rows), "completion_tokens": sum(r.length for r in rows),
        "prompt_tokens": sum(len(r.prompt_ids) for r in rows), "update_forwards": dict(forwards),
        "generation_peak_rss_mib": round(generation_rss, 1), "peak_rss_after_each_role_mib": role_peaks,
    }

if __name__ == "__main__":
    main()
