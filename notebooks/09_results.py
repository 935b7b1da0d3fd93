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
# # 09 · Results: the paper's table beside ours
#
# **What the paper claims** (Qwen3-0.6B, DeepMath-hard, pass@1): untrained MoA
# ~7.6%, vanilla GRPO 30%, competition without exchange 32%, cooperation with
# exchange 46%, Agon with fixed roles 52%, vanilla GRPO on Qwen3-4B 59%, **Agon
# 61%**. The paper's numbers are quoted as reference; ours come from
# `experiments/results/<profile>.csv`, which this notebook rebuilds from the run
# directories (`agonlib.study.results.collect`). On the `cpu` profile (a 135M model on
# arithmetic word problems, minutes of training) compare orderings and gaps, not
# absolute values.
#
# Figures (PNG and SVG under `figures/<profile>/`), drawn only from the run files
# and the results table:
#
# * `pass1_over_training` — held-out pass@1 at each periodic evaluation
#   (`eval.jsonl`), and the drafter's training accuracy each step;
# * `final_pass1` — the paper's pass@1 beside ours for each row of its table;
# * `conversion_rates` — how often the challenger fixes a wrong draft
#   (conversion), breaks a right one (regression), or is right and shorter
#   (tiebreak; it only earns a reward when λ_len > 0);
# * `ab_divergence` — how far apart the adapters' weight updates are and how
#   often A and B answer differently, at each periodic evaluation.
#
# **What to look for.** Agon above the 2×2 cells and GRPO; conversion rates
# above zero and higher under competition; A and B staying apart (divergence
# well above 0) rather than collapsing into one policy.

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)

# %%
from agonlib.study import pipeline

table = pipeline.collect_results(profile, out_dir=out_dir)
table

# %% [markdown]
# The paper's rows beside ours: the `A→B` cascade for the Agon-style cells (`B→A` beside it), the adapter for vanilla GRPO, `moa` for the untrained baseline; the mean over seeds, with each seed's value.

# %%
from agonlib.study import paper

paper.comparison(table)

# %% [markdown]
# **The verdict.** Each of the paper's orderings, judged on our runs: the difference
# `first − second` on the same held-out problems with the same seeds, its mean over
# seeds with a 95% interval, the pooled per-problem transitions and an exact McNemar
# test. `holds` / `reversed` only when the interval excludes zero; otherwise `not
# separated` (`agonlib.study.verdict`).

# %%
from agonlib.study import verdict
from agonlib.study.paths import output_paths

runs_dir = output_paths(profile, out_dir).runs
verdict.orderings(runs_dir)

# %% [markdown]
# How often a training summary still stated the gold answer, per exchange cell.
# The masking of DESIGN.md §2 step 3 removes the drafter's own answer, so a right
# draft should never leak; a wrong draft can still state the gold as a step of its
# reasoning (`5 + 2 = 7`, then a wrong box), which the last two columns count
# in the logged sample rounds. The `cpu` profile's `summary_mask: stated` also
# masks every number the question does not state, and each of its numbers beyond
# as often as the question states it: there no summary can state a non-negative
# gold more often than the question, and every rate here should read 0.

# %%
verdict.leak_rates(runs_dir)

# %%
from agonlib.study import plots

figures = plots.make_figures(profile, "results", out_dir=out_dir)
plots.show(figures)
