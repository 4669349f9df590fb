"""What this machine's CPU is: its model, its family numbers and its feature flags, read
once from /proc/cpuinfo. The C kernels are built for these flags (their cache key holds
them), and every benchmark records them, since a result compares only with a baseline
from the same CPU generation (AVX2 only, or AVX-512 with BF16 and VNNI)."""

from __future__ import annotations

import functools
import platform
from typing import NamedTuple

#: The flags that decide which kernels run and how fast: x86 vector and matrix extensions
#: (avx, avx2, avx512*, avx_vnni, amx_*, fma, f16c) and Arm's (asimd*, sve*).
SIMD_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "asimd", "sve")


class CpuInfo(NamedTuple):
    model: str                 # the model name ("AMD EPYC" on some VMs)
    cpu_id: str | None         # vendor, family, model and stepping numbers
    flags: frozenset[str]

    @property
    def simd_flags(self) -> list[str]:
        return sorted(f for f in self.flags if f.startswith(SIMD_FLAG_PREFIXES))


@functools.cache
def cpu_info() -> CpuInfo:
    """From the first processor in /proc/cpuinfo (they all match); off Linux the name is
    `platform`'s answer and the rest is empty. A VM may show only "AMD EPYC" as the name:
    the family and model numbers still tell the generation (AMD family 25 = Zen 3/4,
    26 = Zen 5)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    cpu_id = (f"{fields.get('vendor_id', '?')} family {fields['cpu family']} model "
              f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}"
              if "cpu family" in fields else None)
    return CpuInfo(name, cpu_id,
                   frozenset((fields.get("flags") or fields.get("Features") or "").split()))


#: Flags of a CPU that computes bfloat16 natively: AVX512_BF16 or AMX-BF16 (x86), BF16
#: (Arm's /proc/cpuinfo "Features"). Without one (AVX2 only: Zen 2/3, pre-Cooper Lake
#: Intel), torch emulates bf16 matmuls through float32 conversions, several times slower
#: than float32 itself.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def has_native_bf16(info: CpuInfo | None = None) -> bool:
    """Whether this CPU (or `info`'s) has native bfloat16 arithmetic."""
    return bool((info or cpu_info()).flags & NATIVE_BF16_FLAGS)
