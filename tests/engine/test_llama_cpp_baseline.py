"""benchmarks/llama_cpp_baseline.py runs llama.cpp's tools as llama.cpp runs by default,
not with the OpenMP setting `import ridgeline` makes for torch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _baseline():
    spec = importlib.util.spec_from_file_location(
        "llama_cpp_baseline", ROOT / "benchmarks" / "llama_cpp_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(os.name != "posix", reason="a shell script stands in for llama-bench")
def test_llama_bench_runs_without_our_omp_wait_policy(tmp_path, monkeypatch):
    # a stand-in llama-bench that reports 1 tok/s when it sees OMP_WAIT_POLICY, else 2
    bench = tmp_path / "llama-bench"
    bench.write_text('#!/bin/sh\nif [ -n "$OMP_WAIT_POLICY" ]; then ts=1; else ts=2; fi\n'
                     'echo "[{\\"n_gen\\": 4, \\"avg_ts\\": $ts, \\"seen\\": \\"$KEEP_ME\\"}]"\n')
    bench.chmod(0o755)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("KEEP_ME", "yes")
    baseline = _baseline()
    assert "OMP_WAIT_POLICY" not in baseline.tool_env()
    assert baseline.tool_env()["KEEP_ME"] == "yes"
    assert baseline.decode_tok_s(tmp_path, tmp_path / "m.gguf", threads=2, depth=0, n=4) == 2.0
