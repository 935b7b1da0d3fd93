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
# # 02 · Agon: competition + exchange, rotating roles
#
# **What the paper claims.** The full method — a competitive reward with the
# conversion bonus, the challenger reading the draft's summary, roles rotating
# every step — reaches **61% pass@1** (Qwen3-0.6B, DeepMath-hard), twice vanilla
# GRPO and above GRPO on a 4B base (59%), with final-stage traces of ~3.5k
# tokens. The rival's success is the signal that a draft's reasoning was weak:
# no process labels, no reward model.
#
# **What to look for.** The drafter alternates A, B, A, … (rotation); a
# conversion rate above zero (the challenger fixes wrong drafts, and is paid
# extra for it); a low leak rate (summaries that still give the gold answer away);
# and both adapters' accuracy moving, since both learn every step.

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
seed = 0  # seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>
steps = None  # training steps; None: the profile's default
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)
force = False  # True: delete the run directory and train again from scratch
overrides = {}  # any other config key, e.g. {"lambda_len": 0.1, "eval_every": 5}

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

run_dir = pipeline.train_cell(profile, "agon", seed=seed, steps=steps, out_dir=out_dir,
                             force=force, **overrides)

# %% [markdown]
# ## The learning curve
#
# Left: held-out pass@1 at every periodic evaluation (`eval.jsonl`: every
# `eval_every` steps, on the first `eval_problems` held-out problems) of the
# profile's `eval_systems` — on `cpu` adapter `A` alone, to keep training cheap;
# 07 evaluates every system at the end. Right: each role's accuracy on the step's
# training problems (`metrics.jsonl`), the drafter's and the challenger's: dots each
# step, the line a trailing mean. Roles rotate, so the drafter is `A` on odd steps
# and `B` on even ones: each line mixes both adapters.

# %%
from agonlib.study import notebook

curve = notebook.show_learning_curve(run_dir)

# %% [markdown]
# ## One sampled round
#
# From the newest step logged in `rollouts.jsonl` (the trainer logs the first
# problems of step 1 and of every `log_rollouts_every`-th step): the problem, one
# draft, the summary the challenger read — the draft without its final answer,
# every occurrence of that answer masked as `[…]` (with `summary_mask: stated`, the
# `cpu` profile's, also the numbers the question does not state) — and the challenge with its
# reward. A pair where the challenger fixed a wrong draft is shown when the step
# has one, else the first pair.

# %%
sampled = notebook.show_sampled_round(run_dir)

# %% [markdown]
# ## The last steps
#
# The columns a reader checks first, for the last logged steps: which adapter
# drafted, each role's training accuracy, the challenger's conversion rate given a
# wrong draft, mean completion lengths, and held-out pass@1 where a periodic
# evaluation ran. Notebooks 08 and 09 plot all of it for every run.

# %%
pipeline.run_summary(run_dir)
