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
# # 08 · Length analysis
#
# **What the paper claims.** Vanilla GRPO on hard problems learns to write
# longer — final-stage traces of ~8.1k tokens — while Agon's final stage stays at
# ~3.5k with higher accuracy: the rival punishes padding that does not make the
# reasoning checkable.
#
# Figures (PNG and SVG under `figures/<profile>/`), drawn only from the run files:
#
# * `length_over_training` — mean completion length per role and run, each step (`metrics.jsonl`);
# * `final_length_distribution` — the final-stage lengths of the final evaluation,
#   Agon's `A→B` cascade against vanilla GRPO, and every run side by side
#   (`final_eval.json`; the last logged rollouts for a run not yet evaluated);
# * `accuracy_vs_length` — accuracy of every logged training rollout binned by
#   length (`rollouts.jsonl`), and each evaluated system's pass@1 against its mean
#   final-stage length (`final_eval.json`).
#
# **What to look for.** A GRPO length curve that climbs while Agon's does not;
# Agon's final-stage distribution sitting left of GRPO's; accuracy falling at the
# longest lengths (often truncated completions: every completion is capped at
# the profile's `max_new_tokens`, a few dozen tokens on `cpu`).

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)

# %%
from agonlib.study import plots

figures = plots.make_figures(profile, "length", out_dir=out_dir)
plots.show(figures)
