# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Baseline: vanilla GRPO (N and compute-matched 2N)
#
# **What the paper claims.** Plain GRPO rewards only the final answer. On hard
# problems the model then learns to write *more* — hedging, backtracking,
# retrying — rather than to reason better: 30% pass@1 on DeepMath-hard with
# Qwen3-0.6B, with final-stage traces of ~8.1k tokens (Agon: 61%, ~3.5k).
#
# Two runs, one adapter each: `grpo` samples `N` completions per problem; `grpo_2n`
# samples `2N`, the same number of rollouts per step as Agon (`N` drafts plus `N`
# challenges) — the compute-matched comparison.
#
# **What to look for.** Drafter accuracy over the steps, and whether completion
# length grows with it; the fraction of groups whose rewards are all equal
# (`zero_std_frac` in `metrics.jsonl`: no learning signal from those problems).

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
seed = 0  # seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>
steps = None  # training steps; None: the profile's default
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)
force = False  # True: delete the run directory and train again from scratch
overrides = {}  # any other config key, e.g. {"lambda_len": 0.1, "eval_every": 5}
cells = ["grpo", "grpo_2n"]  # the experiment cells of experiments/cells.yaml

# %% [markdown]
# ## Training
#
# A run that already finished (its final checkpoint is complete) is skipped; an
# unfinished one resumes from its newest checkpoint; `force = True` trains it again
# from scratch. Everything shown below, and everything notebooks 07–09 use, is read
# from the run directory (`config.json`, `metrics.jsonl`, `eval.jsonl`,
# `rollouts.jsonl`, checkpoints).

# %%
from agonlib.study import pipeline

run_dirs = {cell: pipeline.train_cell(profile, cell, seed=seed, steps=steps, out_dir=out_dir,
                                      force=force, **overrides)
            for cell in cells}

# %% [markdown]
# ## The learning curve
#
# Left: held-out pass@1 of each run's adapter at every periodic evaluation
# (`eval.jsonl`: every `eval_every` steps, on the first `eval_problems` held-out
# problems). Right: the adapter's accuracy on each step's training problems
# (`metrics.jsonl`; vanilla GRPO has one role, the drafter): dots each step, the
# line a trailing mean. Both runs in one figure: `grpo` samples `N` completions per
# problem, `grpo_2n` `2N`.

# %%
from agonlib.study import notebook

curve = notebook.show_learning_curve(run_dirs.values())

# %% [markdown]
# ## One sampled round
#
# From the newest step logged in `rollouts.jsonl` (the trainer logs the first
# problems of step 1 and of every `log_rollouts_every`-th step): the problem and one
# draft of each run — vanilla GRPO has no challenger and no summary. A correct
# draft is shown when the step has one, else the first.

# %%
for run_dir in run_dirs.values():
    sampled = notebook.show_sampled_round(run_dir)
    print()

# %% [markdown]
# ## The last steps
#
# The columns a reader checks first, for the last logged steps: which adapter
# drafted, each role's training accuracy, the challenger's conversion rate given a
# wrong draft, mean completion lengths, and held-out pass@1 where a periodic
# evaluation ran. Notebooks 08 and 09 plot all of it for every run.

# %%
for cell, run_dir in run_dirs.items():
    print(f"{cell}: {run_dir}")
    display(pipeline.run_summary(run_dir))
