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
