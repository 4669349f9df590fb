"""tests/rl: the trainer's dtype "auto" resolves as on a CPU without native bf16
(float32) whatever this machine's CPU, so that the tests that check the trainer's float32
agreement with the engine mean the same on every machine; `test_memory.py` tests the
resolution itself, and tests that want bf16 ask for it."""

from __future__ import annotations

import pytest

from ridgeline.rl import trainer as trainer_mod


@pytest.fixture(autouse=True)
def _trainer_auto_dtype_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_mod, "has_native_bf16", lambda: False)
