"""llama.cpp as a side-by-side baseline for single-request decode (optional).

llama.cpp is not a dependency: point `--llama-cpp DIR` of engine_bench.py at a folder
holding its `llama-bench` and `llama-quantize` binaries (docs/benchmarks.md: how to build
them from the `llama-cpp-python` source package on PyPI). The default model is a Q4_1
GGUF that Ridgeline dequantizes on load, so `llama-quantize --allow-requantize` to F32,
BF16 or Q8_0 gives llama.cpp the very weights each of our settings runs (float32,
bfloat16, int8 per channel ~ Q8_0's int8 per 32-block), plus the Q4_1 file as shipped.

Decode is measured as llama-bench's text generation at a context depth equal to our
prompt (`-d`), with the same thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

#: our setting -> the GGUF type that holds the same numbers in llama.cpp
GGUF_TYPE = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0"}


def _binary(tool_dir: Path, name: str) -> Path:
    path = tool_dir / name
    if not path.is_file():
        raise SystemExit(f"--llama-cpp: {path} not found (build llama.cpp's {name} target; "
                         "see docs/benchmarks.md)")
    return path


def tool_env() -> dict[str, str]:
    """The environment llama.cpp's tools run in: ours without OMP_WAIT_POLICY, which
    `import ridgeline` sets to PASSIVE for torch. llama.cpp's own OpenMP threads would then
    sleep at every barrier of a token: Q4_1, tg128 at depth 128, 2 threads, Zen 5: 38.9
    tok/s with it, 151.9 without (its default)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def requantize(tool_dir: Path, gguf: Path, ggml_type: str, out_dir: Path) -> Path:
    """`gguf` rewritten as `ggml_type` (F32, BF16, Q8_0, ...) in out_dir."""
    out = out_dir / f"{gguf.stem}.{ggml_type}.gguf"
    subprocess.run([str(_binary(tool_dir, "llama-quantize")), "--allow-requantize",
                    str(gguf), str(out), ggml_type],
                   check=True, capture_output=True, text=True, timeout=600, env=tool_env())
    return out


def decode_tok_s(tool_dir: Path, gguf: Path, *, threads: int, depth: int, n: int,
                 repetitions: int = 3) -> float:
    """llama-bench's mean tokens/s generating n tokens after `depth` tokens of context."""
    proc = subprocess.run(
        [str(_binary(tool_dir, "llama-bench")), "-m", str(gguf), "-t", str(threads),
         "-p", "0", "-n", str(n), "-d", str(depth), "-r", str(repetitions), "-o", "json"],
        check=True, capture_output=True, text=True, timeout=900, env=tool_env())
    rows = [r for r in json.loads(proc.stdout) if r.get("n_gen") == n]
    if not rows:
        raise RuntimeError(f"llama-bench printed no generation result: {proc.stdout[:200]}")
    return float(rows[0]["avg_ts"])


def single_request(tool_dir: str, gguf: Path, settings: list[str], *, threads: int,
                   depth: int, n: int) -> dict[str, float]:
    """tok/s per GGUF type: the shipped file's own type and one per our setting."""
    tools = Path(tool_dir)
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ridgeline-llamacpp-") as tmp:
        shipped = gguf.stem.rsplit(".", 1)[-1]  # e.g. SmolLM2-135M-Instruct.Q4_1
        result[shipped] = decode_tok_s(tools, gguf, threads=threads, depth=depth, n=n)
        for setting in settings:
            ggml_type = GGUF_TYPE[setting]
            path = requantize(tools, gguf, ggml_type, Path(tmp))
            result[ggml_type] = decode_tok_s(tools, path, threads=threads, depth=depth, n=n)
            path.unlink()
    return result
