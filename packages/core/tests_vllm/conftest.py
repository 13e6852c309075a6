"""Tests of kvtier's vLLM connector inside real vLLM engines (``nox -s tests-vllm``).

Every engine runs in its own process (``kvtier_tools.bench.vllm.run_in_subprocess``): a new
engine per configuration, results as plain data; module-scoped fixtures share each engine's
results across the tests that read them. Nothing is fetched from a model hub: the model is a
random-weight Llama saved to a temporary directory, prompts are token ids.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def deepseek_v2(tmp_path_factory):
    """A tiny random-weight DeepSeek-V2 (MLA), saved once for every module."""
    from kvtier_tools.bench.vllm import make_deepseek_v2
    return make_deepseek_v2(str(tmp_path_factory.mktemp("mla") / "deepseek-v2"))


@pytest.fixture(scope="session")
def mla_block(deepseek_v2):
    """The block size this CPU's MLA backend takes: 16 for vLLM's reference kernel, multiples
    of 32 for the AMX one, picked by the CPU; the engine's own refusal says which."""
    from kvtier_tools.bench.vllm import run_in_subprocess
    for bs in (16, 32):
        res = run_in_subprocess({"model": deepseek_v2, "engine": {"block_size": bs},
                                 "phases": []}, timeout=300)
        if "start_error" not in res:
            return bs
        assert "block size" in res["start_error"]["message"], res["start_error"]
    pytest.fail("vLLM's CPU MLA backend took neither block size 16 nor 32")
