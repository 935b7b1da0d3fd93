"""Command line: ``python -m agonlib <command> --help``.

Commands:

* ``train``      — a training run (a profile or YAML, an experiment cell, overrides).
* ``eval``       — final evaluation of a run directory (or a config's untrained policies).
* ``solve``      — the cascade of a trained run on one problem: draft summary and final answer.
* ``round``      — one draft → summary → challenge round, printed readably.
* ``gate``       — can the untrained challenger use the challenge prompt? (DESIGN.md §8)
* ``verdict``    — the paper's orderings judged over the seeds of several committed results reports.
* ``reproduce``  — the README's main job: every numbered notebook through papermill.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import prompts
from .config import ConfigError, load_config, parse_override
from .evaluation import evaluate
from .gate import format_gate, gate_path, run_gate, write_gate
from .generation import generate, sample_seed
from .models import AssetError, load_policies, resolved_dtype
from .runs import CheckpointError, latest_adapters, load_run_config
from .study.pipeline import show_round
from .study.pipeline import text_block as _block
from .study.reproduce import main as reproduce_main
from .study.results import across_reports, to_markdown
from .study.verdict import ReportError, combine
from .trainer import train


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="cpu", help="profile name or YAML path (default: cpu)")
    parser.add_argument("--cell", default=None, help="an experiment cell of experiments/cells.yaml, e.g. agon")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set steps=4")


def _load(args) -> object:
    overrides = dict(parse_override(item) for item in args.overrides)
    return load_config(args.profile, cell=args.cell, **overrides)


def cmd_round(args) -> int:
    config = _load(args)
    print(f"Loading {config.model} (profile {config.profile}) …", flush=True)
    policies = load_policies(config)
    print(f"  {policies.device}, {policies.dtype}, loaded with {policies.model_loader} "
          f"in {policies.load_seconds:.1f} s", flush=True)
    report = policies.memory_report()
    print(f"  base {report['base_params'] / 1e6:.1f}M params; each adapter adds "
          f"{report['adapter_A_fraction']:.2%}", flush=True)
    show_round(policies, config, problems=args.problems, generations=args.generations, progress=True)
    return 0


def cmd_gate(args) -> int:
    config = _load(args)
    path = Path(args.out) if args.out else gate_path(config.profile, dtype=resolved_dtype(config))
    path = write_gate(run_gate(config, progress=True), path)
    result = json.loads(path.read_text())
    print(format_gate(result))
    print(f"Written to {path}")
    return 0 if result["passed"] or not args.strict else 1


def cmd_train(args) -> int:
    config = _load(args)
    if args.resume:
        config = config.replace(resume=True)
    run_dir = train(config)
    print(f"Run written to {run_dir}")
    return 0


def cmd_eval(args) -> int:


    target = args.target
    if not Path(target).is_dir():  # a profile or YAML: evaluate that config's untrained policies
        args.profile = target
        target = _load(args)
    elif args.overrides or args.cell:
        raise SystemExit(f"--set and --cell apply to a profile; the run directory {target} is evaluated with the "
                         "config it was trained with (its config.json).")
    result = evaluate(target, systems=args.systems or None, n_problems=args.problems, samples=args.samples)
    print(f"{'system':12s} {'pass@1':>7s} {'final len':>10s} {'tokens/problem':>15s}")
    for name, row in result.items():
        if isinstance(row, dict) and "pass@1" in row:
            print(f"{name:12s} {row['pass@1']:7.3f} {row['mean_final_len']:10.1f} {row['tokens_per_problem']:15.1f}")
    disagree = result.get("meta", {}).get("A_B_disagreement")
    if disagree is not None:
        print(f"A/B answer disagreement: {disagree:.3f}")
    return 0


def cmd_solve(args) -> int:


    run_dir = Path(args.run)
    config = load_run_config(run_dir)
    if config.mode == "grpo":
        raise SystemExit(f"{run_dir} is a vanilla GRPO run (one adapter): there is no cascade to solve with.")
    adapters = latest_adapters(run_dir)
    if adapters is None:
        raise SystemExit(f"{run_dir} has no complete checkpoint to solve with.")
    policies = load_policies(config)
    for name in ("A", "B"):
        policies.load_adapter(name, adapters)

    first, second = args.order[0], args.order[1]
    render = lambda m: prompts.render(policies.tokenizer, m, config.thinking)  # noqa: E731
    draft = generate(policies, [render(prompts.draft_prompt(args.problem, config.task))], first,
                     [sample_seed(args.seed, 0, 0, 0, "solve/draft")], progress=False)[0]
    summary = prompts.challenge_summary(draft.summary, args.problem, config)
    [text], _ = prompts.challenge_texts(policies.tokenizer, [args.problem], [summary], config.reward, config.task,
                                        config.thinking, config.max_prompt_tokens)
    final = generate(policies, [text], second,
                     [sample_seed(args.seed, 0, 0, 0, "solve/final")], progress=False)[0]
    print(_block(f"draft summary ({first})", summary))
    print(_block(f"final solution ({second})", final.text))
    print(f"FINAL ANSWER: {final.answer}")
    return 0


def cmd_verdict(args) -> int:
    table = to_markdown(combine(args.reports))
    print(table)
    if args.out:
        command = " ".join(["python -m agonlib verdict", *args.reports, "--out", args.out])
        seeds = ", ".join(Path(report).with_suffix("").name for report in args.reports)
        Path(args.out).write_text(
            f"# The paper's orderings over the seeds of {seeds}\n\n"
            f"Written by `{command}` from the committed results tables alone (agonlib.study.verdict.combine): "
            "each seed's difference from the CSVs, a t-interval over the seeds, McNemar on the reports' "
            "discordant counts summed over seeds.\n\n" + table + "\n\n"
            "## pass@1 across seeds (mean, 95% t-interval; agonlib.study.results.across_reports)\n\n"
            + to_markdown(across_reports(args.reports)) + "\n")
        print(f"wrote {args.out}")
    return 0


def cmd_reproduce(args) -> int:
    return reproduce_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agonlib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_round = sub.add_parser("round", help="play one draft → summary → challenge round and print it")
    _config_args(p_round)
    p_round.add_argument("--problems", type=int, default=2, help="problems in the round (default 2)")
    p_round.add_argument("--generations", type=int, default=2, help="drafts per problem (default 2)")
    p_round.set_defaults(func=cmd_round)
    p_gate = sub.add_parser("gate", help="measure whether the untrained challenger can use the challenge prompt",
                            description="Draft/challenge pairs of the untrained adapters on held-out problems "
                                        "(gate_problems x num_generations): boxed rate, truncation, accuracy, "
                                        "conversion and regression of drafts and of challenges with and without "
                                        "exchange. Writes experiments/gate/<profile>.json (<profile>-<dtype>.json "
                                        "outside float32).")
    _config_args(p_gate)
    p_gate.add_argument("--out", default=None, help="where to write the JSON (default experiments/gate/<profile>.json, "
                        "<profile>-<dtype>.json outside float32)")
    p_gate.add_argument("--strict", action="store_true", help="exit 1 when the gate fails")
    p_gate.set_defaults(func=cmd_gate)
    p_train = sub.add_parser("train", help="run (or resume) a training run")
    p_train.add_argument("profile", nargs="?", default="cpu", help="profile name or YAML path (default: cpu)")
    p_train.add_argument("--cell", default=None, help="an experiment cell of experiments/cells.yaml")
    p_train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p_train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p_train.set_defaults(func=cmd_train)
    p_eval = sub.add_parser("eval", help="evaluate a run directory, or a profile's untrained policies")
    p_eval.add_argument("target", help="a run directory, a profile name or a YAML path")
    p_eval.add_argument("--systems", nargs="*", help="base A B cascade_AB cascade_BA moa grpo")
    p_eval.add_argument("--problems", type=int, default=None, help="held-out problems (default: final_eval_problems, else the whole held-out split)")
    p_eval.add_argument("--samples", type=int, default=None, help="samples per problem (default: eval_samples)")
    p_eval.add_argument("--cell", default=None)
    p_eval.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p_eval.set_defaults(func=cmd_eval)
    p_solve = sub.add_parser("solve", help="the trained cascade on one problem")
    p_solve.add_argument("problem", help="the problem text")
    p_solve.add_argument("--run", required=True, help="a run directory with a checkpoint")
    p_solve.add_argument("--order", default="AB", choices=["AB", "BA"], help="drafter then answerer")
    p_solve.add_argument("--seed", type=int, default=0)
    p_solve.set_defaults(func=cmd_solve)
    p_verdict = sub.add_parser(
        "verdict", help="the paper's orderings judged over the seeds of several results reports",
        description="Judge the paper's orderings over every seed of several results reports (a results CSV with "
                    "its Markdown beside it, e.g. experiments/results/cpu-bf16.csv), without their run "
                    "directories: seeds trained in separate runs judged together.")
    p_verdict.add_argument("reports", nargs="+", help="results reports: <name>.csv with <name>.md beside it")
    p_verdict.add_argument("--out", default=None, help="also write the table, with the command, to this Markdown file")
    p_verdict.set_defaults(func=cmd_verdict)
    p_repro = sub.add_parser(
        "reproduce", help="the main job: every numbered notebook through papermill",
        description="Run notebooks/00_setup … 09_results in order through papermill. Executed copies and "
                    "logs go to experiments/runs/<profile>/notebooks/, figures to figures/<profile>/. "
                    "Finished training runs and evaluations are skipped unless --force.")
    p_repro.add_argument("--profile", default=None, help="profile name (default: cpu)")
    p_repro.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="a notebook parameter (seed, steps, eval_problems …) or any config key, which goes "
                              "into the notebooks' `overrides` (repeatable), e.g. --set steps=4")
    p_repro.add_argument("--params", default=None, metavar="YAML",
                         help="a parameter file: settings as with --set, plus `notebooks: {07: {…}}`")
    p_repro.add_argument("--only", default=None, metavar="NN,NN", help="run only these notebooks, e.g. 08,09")
    p_repro.add_argument("--jobs", type=int, default=None,
                         help="training notebooks (01-06) at a time; default min(2, cores), 1 on colab/paper")
    p_repro.add_argument("--force", action="store_true", help="retrain and re-evaluate runs that already exist")
    p_repro.add_argument("--seeds", default=None, metavar="K|S,S",
                         help="train every cell for each seed: a count (3: seeds 0,1,2) or a list (0,1,2)")
    p_repro.add_argument("--skip-gate", action="store_true",
                         help="do not run (or reuse) the gate before training (experiments/gate/<profile>.json)")
    p_repro.add_argument("--out-dir", default=None,
                         help="write runs, results and figures under this folder instead of the repo "
                              "(also: $AGON_OUT_DIR)")
    p_repro.add_argument("--notebooks-dir", default=None, help=argparse.SUPPRESS)
    p_repro.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebooks' python3)")
    p_repro.set_defaults(func=cmd_reproduce)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    try:
        return args.func(args)
    except ConfigError as err:
        print(f"Config error: {err}", file=sys.stderr)
        return 2
    except (AssetError, CheckpointError, FileExistsError, FileNotFoundError, ReportError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
