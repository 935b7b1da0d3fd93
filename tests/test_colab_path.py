"""The Colab/GPU path of issue 17, proven on CPU with stand-ins for the GPU stack.

No GPU, Unsloth or vLLM here: ``torch.cuda`` is monkeypatched to describe a card,
``unsloth`` is a fake module in ``sys.modules`` whose ``FastLanguageModel`` loads
with plain transformers and records its arguments, and ``importlib.util.find_spec``
says which of ``unsloth``/``vllm`` are "installed". Each test fails on the code
before issue 17's fixes.
"""

import importlib.machinery
import importlib.util
import json
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import agonlib.models as models
from agonlib import agon, load_config, load_policies
from agonlib.config import REPO_ROOT
from agonlib.models import load_base, pick_dtype
from agonlib.trainer import Trainer

CUDA = torch.device("cuda")  # a device object only: nothing is ever moved to it


# --- item 2: bf16 only where the card runs it natively -------------------------------------------

@pytest.mark.parametrize("capability, expected", [((7, 5), torch.float16),  # T4
                                                  ((8, 0), torch.bfloat16),  # A100
                                                  ((8, 9), torch.bfloat16),  # L4
                                                  ((9, 0), torch.bfloat16)])  # H100
def test_auto_dtype_follows_the_compute_capability(monkeypatch, capability, expected):
    # torch.cuda.is_bf16_supported() counts emulation: True on a T4, where vLLM refuses bf16.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert pick_dtype("auto", CUDA) == expected


def test_policies_record_the_dtype_the_weights_really_have(monkeypatch, caplog):
    # Unsloth, asked for bf16 on a T4, silently loads fp16; the recorded dtype must be the loaded one.
    load_tiny = models._load_tiny_qwen3
    monkeypatch.setattr(models, "_load_tiny_qwen3", lambda config, dtype: load_tiny(config, torch.float16))
    with caplog.at_level(logging.WARNING, logger="agonlib.models"):
        policies = load_policies(load_config("smoke", device="cpu", dtype="bfloat16"))
    assert policies.dtype == torch.float16
    assert "loaded the base in torch.float16" in caplog.text


# --- item 1: Unsloth only with its vLLM engine -----------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The smoke model as a local directory: a source Unsloth would load (tiny-qwen3 never goes there)."""
    config = load_config("smoke", device="cpu", dtype="float32")
    base, tokenizer, _ = load_base(config)
    path = tmp_path_factory.mktemp("model")
    base.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _stay_on_cpu(model):
    model.to = lambda *args, **kwargs: model  # load_base moves the model to "cuda": there is none here
    return model


def _fake_packages(monkeypatch, installed: set) -> set:
    """``find_spec`` sees unsloth and vllm exactly when they are in ``installed`` (returned, to add to later)."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("unsloth", "vllm"):
            return importlib.machinery.ModuleSpec(name, None) if name in installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return installed


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA machine with Unsloth installed; add "vllm" to ``.installed`` to have vLLM too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    installed = _fake_packages(monkeypatch, {"unsloth"})
    calls = []

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(source, dtype, **kwargs):
            calls.append(kwargs)
            model, tokenizer = models._load_pretrained(source, dtype, torch.device("cpu"))
            return _stay_on_cpu(model), tokenizer

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    load_pretrained = models._load_pretrained
    monkeypatch.setattr(models, "_load_pretrained",
                        lambda *args: (lambda m, t: (_stay_on_cpu(m), t))(*load_pretrained(*args)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return SimpleNamespace(installed=installed, unsloth_calls=calls)


def test_unsloth_loads_the_base_only_when_rollouts_go_through_vllm(fake_gpu, model_dir, caplog):
    config = load_config("smoke", model=str(model_dir), device="cpu", dtype="float32")
    # Without vLLM rollouts go through transformers, which Unsloth's tuple KV caches would crash.
    with caplog.at_level(logging.INFO, logger="agonlib.models"):
        _, _, backend = load_base(config, CUDA, torch.float32)
    assert backend == "transformers" and fake_gpu.unsloth_calls == []
    [line] = [r.getMessage() for r in caplog.records if "not Unsloth" in r.getMessage()]
    assert "vLLM not installed" in line and "tuple KV caches" in line

    fake_gpu.installed.add("vllm")  # now Unsloth brings its shared vLLM engine
    _, _, backend = load_base(config, CUDA, torch.float32)
    assert backend == "unsloth"
    assert fake_gpu.unsloth_calls[-1]["fast_inference"] is True and fake_gpu.unsloth_calls[-1]["max_loras"] == 2

    # vLLM installed but rollouts asked of transformers; or data parallelism, where vLLM is refused.
    for overrides, env in (({"generation_engine": "transformers"}, "1"), ({}, "2")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("WORLD_SIZE", env)
            _, _, backend = load_base(config.replace(**overrides), CUDA, torch.float32)
        assert backend == "transformers", (overrides, env)
    assert len(fake_gpu.unsloth_calls) == 1


def test_model_loader_unsloth_without_vllm_is_honoured_with_a_warning(fake_gpu, model_dir, caplog):
    config = load_config("smoke", model=str(model_dir), device="cpu", dtype="float32", model_loader="unsloth")
    with caplog.at_level(logging.WARNING, logger="agonlib.models"):
        _, _, backend = load_base(config, CUDA, torch.float32)
    assert backend == "unsloth"
    assert fake_gpu.unsloth_calls == [{"max_seq_length": config.max_sequence_tokens,
                                       "load_in_4bit": False}]  # no vLLM engine: no fast_inference
    assert "tuple-cache-safe decode loop" in caplog.text and "vllm==0.32.0" in caplog.text


# --- item 6: loss scaling in fp16 -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_loss_scaling_outside_fp16(tmp_path, dtype):
    trainer = Trainer(load_config("smoke", dtype=dtype, device="cpu", out_dir=str(tmp_path)), progress=False, dp=None)
    assert trainer.scalers == {}


def test_fp16_trains_with_one_grad_scaler_per_adapter_and_checkpoints_it(tmp_path, monkeypatch):
    config = load_config("smoke", dtype="float16", device="cpu", out_dir=str(tmp_path), max_new_tokens=6,
                         num_generations=4)
    trainer = Trainer(config, progress=False, dp=None)
    assert set(trainer.scalers) == {"A", "B"} and trainer.scalers["A"] is not trainer.scalers["B"]
    # A grader that varies within groups (the random model never answers right), so both roles update.
    monkeypatch.setattr(agon, "grade", lambda rollouts, problems, cfg: [i % 2 for i in range(len(rollouts))])
    seen = []
    real_update = agon.grpo_update
    monkeypatch.setattr(agon, "grpo_update",
                        lambda *args, scaler=None, **kwargs: seen.append(scaler) or real_update(*args, scaler=scaler,
                                                                                               **kwargs))
    row, rnd = trainer.train_step(1)
    assert seen == [trainer.scalers[rnd.drafter], trainer.scalers[rnd.challenger]]
    assert row["drafter/skipped_nonfinite"] == 0 and row["challenger/skipped_nonfinite"] == 0

    trainer.scalers["B"].update(new_scale=1024.0)  # as after a few overflows
    trainer.step = 1
    path = trainer.save_checkpoint()
    resumed = Trainer(config, policies=trainer.policies, progress=False, dp=None)
    resumed.load_checkpoint(path)
    assert resumed.scalers["B"].get_scale() == 1024.0
    assert resumed.scalers["A"].get_scale() == trainer.scalers["A"].get_scale()


# --- item 3 (and 8): the GPU install ----------------------------------------------------------------

def test_the_gpu_extra_pins_vllm_and_unsloth():
    import tomllib

    from agonlib.generation.backends import VLLM_VERSION

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    gpu = project["optional-dependencies"]["gpu"]
    assert f"vllm=={VLLM_VERSION}" in gpu and "vllm==0.32.0" in gpu  # 0.33.0 needs torch 2.14
    assert "unsloth==2026.10.9" in gpu and "torch==2.13.0" in project["dependencies"]


def _colab_install_cell() -> str:
    notebook = json.loads((REPO_ROOT / "notebooks" / "00_setup.ipynb").read_text())
    [cell] = [c for c in notebook["cells"] if c["cell_type"] == "code" and "google.colab" in "".join(c["source"])]
    return "".join(cell["source"])


@pytest.fixture
def colab(monkeypatch):
    """The install cell of notebook 00 run as on Colab: git and pip commands recorded, not run."""
    import os
    import subprocess

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    commands, installed = [], _fake_packages(monkeypatch, set())
    monkeypatch.setattr(subprocess, "run", lambda cmd, check=False: commands.append(" ".join(cmd)))
    monkeypatch.setattr(os, "chdir", lambda path: None)

    def run():
        namespace = {"profile": "cpu"}
        exec(_colab_install_cell(), namespace)  # noqa: S102 — our own generated notebook cell
        return namespace

    return SimpleNamespace(run=run, commands=commands, installed=installed)


def test_colab_cell_installs_vllm_before_unsloth_then_asks_for_a_restart(colab, monkeypatch):
    with pytest.raises(SystemExit, match=r"restart the runtime .* does not install again"):
        colab.run()
    pip = [c for c in colab.commands if " pip install " in c]
    [vllm] = [i for i, c in enumerate(pip) if "vllm==0.32.0" in c]
    [gpu] = [i for i, c in enumerate(pip) if "/content/agon[gpu]" in c]
    assert vllm < gpu  # Unsloth patches vLLM at its first import: vLLM must be there before

    # After the restart: nothing is installed again; without a GPU (or with too old a driver) it stops.
    colab.installed.update({"vllm", "unsloth"})
    colab.commands.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"sees no CUDA GPU.*GPU runtime.*driver.*CUDA 13"):
        colab.run()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert colab.run()["profile"] == "colab"
    assert not [c for c in colab.commands if " pip install " in c]
