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
# # 07 · Evaluation: every system on the held-out problems
#
# **What the paper claims.** Deployed, the pair is a **two-stage cascade**: one
# adapter drafts, the other reads the summary and writes the final answer — 61%
# pass@1 for Agon on DeepMath-hard, against 30% for the vanilla GRPO adapter and
# ~7.6% for an untrained Mixture-of-Agents (MoA: `K` base-model proposals and a
# base-model aggregator).
#
# This notebook runs `agonlib.evaluate` on every run of the profile: `A`, `B`,
# `cascade_AB`, `cascade_BA` for the Agon-style runs, the adapter of each vanilla
# GRPO run, and — once per seed, on the `agon` run — the untrained `base` and
# `moa`. Each run's results go to its `final_eval.json` (pass@1, final-stage
# lengths, tokens per problem, A/B answer disagreement). A run already evaluated
# on its newest checkpoint is skipped unless `force = True`.
#
# **What to look for.** Does a cascade beat each adapter alone? Do trained
# adapters beat `base`? On the `cpu` profile the 135M model often derails on the
# long challenge prompt, so cascades can score *below* single adapters there
# (`experiments/LOG.md`).

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)
force = False  # re-evaluate runs already evaluated on their newest checkpoint
systems = None  # None: each run's own systems (plus base and moa once per seed)
eval_problems = None  # held-out problems; None: the profile's final_eval_problems (null: the whole split)
jobs = None  # runs evaluated at a time, each in its own process; None: two on a CPU, one on a GPU

# %%
from agonlib.study import pipeline

results = pipeline.evaluate_runs(profile, systems=systems, out_dir=out_dir, force=force,
                                 eval_problems=eval_problems, jobs=jobs)
pipeline.evaluation_table(results)
