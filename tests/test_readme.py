"""The README's Python examples run as written (reference backend on the CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# the vLLM block needs vLLM and a model: tests_vllm/ starts engines with the same switch (scripts/test.sh)
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
BLOCKS = [b for b in BLOCKS if "from vllm" not in b]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch reference path, as on a CPU install
    exec(compile(code, str(README), "exec"), {})
