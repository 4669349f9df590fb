"""The RL run directory: durable metrics.jsonl, strictly increasing steps, resume
truncation (later lines and a torn line dropped, TensorBoard purged), refusing to mix two
runs, TensorBoard events read back from their TFRecord framing, plots, progress line."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest

from ridgeline.errors import ConfigError, NotFoundError
from ridgeline.rl import run_log as run_log_mod
from ridgeline.rl.run_log import RunLog, format_progress, read_metrics
from ridgeline.rl.run_plots import plot_run

# ---- reading TensorBoard event files (tensorboardX has no reader) ---------------------


def _records(path: Path) -> list[bytes]:
    """The payloads of a TFRecord file: u64 length, u32 masked crc of it, data, u32 crc."""
    from tensorboardX.record_writer import masked_crc32c

    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert hcrc == masked_crc32c(header)
        payload = data[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        assert dcrc == masked_crc32c(payload)
        out.append(payload)
        pos += 16 + length
    assert pos == len(data)
    return out


def _events(path: Path) -> list:
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for payload in _records(path):
        ev = Event()
        ev.ParseFromString(payload)
        events.append(ev)
    return events


def _event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def _scalars(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for ev in _events(path):
        if ev.HasField("summary"):
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


# ---- metrics.jsonl ----------------------------------------------------------------------


def test_lines_are_appended_and_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(run_log_mod.os, "fsync", fsync)
    run = tmp_path / "run"
    with RunLog(run, tensorboard=False) as rl:
        rl.log(0, {"reward_mean": 0.25, "note": "warm-up", "lens": [3, 4]})
        n0 = len(synced)
        # readable by another reader before close: written through, not buffered
        assert read_metrics(run)[0]["reward_mean"] == 0.25
        rl.log(1, {"reward_mean": 0.5, "step": 1.0})  # AsyncRLLoop's own 'step' entry
        assert len(synced) > n0
        assert rl.last_step == 1
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    recs = [json.loads(ln) for ln in lines]
    assert [r["step"] for r in recs] == [0, 1]
    assert recs[0]["note"] == "warm-up" and recs[0]["lens"] == [3, 4]
    assert all(isinstance(r["time"], float) for r in recs)
    assert list(recs[1]) == ["step", "time", "reward_mean"]  # 'step' not repeated
    assert read_metrics(run) == recs


def test_non_finite_values_are_null_and_numpy_scalars_convert(tmp_path):
    np = pytest.importorskip("numpy")
    with RunLog(tmp_path, tensorboard=False) as rl:
        rl.log(0, {"reward_mean": float("nan"), "x": float("inf"), "n": np.int64(3),
                   "f": np.float32(0.5), "hist": {0: 7, "1": 2}})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    rec = read_metrics(tmp_path)[0]
    assert rec["reward_mean"] is None and rec["x"] is None
    assert rec["n"] == 3 and rec["f"] == 0.5 and rec["hist"] == {"0": 7, "1": 2}


def test_non_increasing_step_raises(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as rl:
        rl.log(3, {"a": 1})
        for bad in (3, 2):
            with pytest.raises(ConfigError) as e:
                rl.log(bad, {"a": 1})
            assert e.value.hint
        rl.log(4, {"a": 1})
        with pytest.raises(ConfigError):
            rl.log(9, {"step": 8.0})  # a 'step' entry that disagrees
        with pytest.raises(ConfigError):
            rl.log(10, {"time": 1.0})  # reserved
    assert [r["step"] for r in read_metrics(tmp_path)] == [3, 4]


def test_log_after_close_raises(tmp_path):
    rl = RunLog(tmp_path, tensorboard=False)
    rl.close()
    rl.close()  # idempotent
    with pytest.raises(ValueError):
        rl.log(0, {})


def test_torn_last_line_is_tolerated_by_readers(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as rl:
        for s in range(3):
            rl.log(s, {"reward_mean": s / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "time": 17.5, "reward_me')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_corrupt_middle_line_raises_not_silently_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\ngarbage\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_metrics(tmp_path)


def test_read_metrics_missing(tmp_path):
    assert read_metrics(tmp_path) == []
    with pytest.raises(NotFoundError):
        read_metrics(tmp_path / "nope")


# ---- resume -----------------------------------------------------------------------------


def test_resume_drops_later_lines_and_a_torn_line(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as rl:
        for s in range(6):
            rl.log(s, {"reward_mean": s / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "ti')
    with RunLog(tmp_path, resume_step=3, tensorboard=False) as rl:
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
        assert rl.last_step == 3
        with pytest.raises(ConfigError):
            rl.log(3, {"reward_mean": 0.0})
        rl.log(4, {"reward_mean": 0.9})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[-1]["reward_mean"] == 0.9
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and "ti\n" not in text
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_rewrites_atomically(tmp_path, monkeypatch):
    with RunLog(tmp_path, tensorboard=False) as rl:
        for s in range(4):
            rl.log(s, {"a": s})
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        replaced.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(run_log_mod.os, "replace", replace)
    RunLog(tmp_path, resume_step=1, tensorboard=False).close()
    assert replaced == [("metrics.jsonl.tmp", "metrics.jsonl")]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_resume_of_a_torn_only_file_and_a_missing_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 0, "tim')
    RunLog(tmp_path / "a", resume_step=0, tensorboard=False).close()
    assert read_metrics(tmp_path / "a") == []
    with RunLog(tmp_path / "b", resume_step=5, tensorboard=False) as rl:
        with pytest.raises(ConfigError):
            rl.log(5, {})
        rl.log(6, {"a": 1})


def test_new_run_in_a_used_directory_raises(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as rl:
        rl.log(0, {"a": 1})
    with pytest.raises(ConfigError) as e:
        RunLog(tmp_path, tensorboard=False)
    assert "--resume" in str(e.value) and "new run directory" in str(e.value)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]  # untouched
    # an empty metrics.jsonl (created, nothing logged) is a fresh directory
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text("")
    RunLog(fresh, tensorboard=False).close()


def test_bad_resume_step(tmp_path):
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError):
            RunLog(tmp_path, resume_step=bad, tensorboard=False)


# ---- TensorBoard ------------------------------------------------------------------------


def test_tensorboard_scalars_written(tmp_path):
    with RunLog(tmp_path) as rl:
        rl.log(0, {"reward_mean": 0.25, "pass_rate/shell-basics": 0.5, "flag": True,
                   "name": "x", "bad": float("nan"), "staleness_hist": {"0": 30, "1": 10},
                   "lens": [1, 2]})
        rl.log(1, {"reward_mean": 0.75, "pass_rate/shell-basics": 1})
    (path,) = _event_files(tmp_path)
    scalars = _scalars(path)
    assert scalars["reward_mean"] == {0: 0.25, 1: 0.75}
    assert scalars["pass_rate/shell-basics"] == {0: 0.5, 1: 1.0}
    assert scalars["staleness_hist/0"] == {0: 30.0}
    assert scalars["staleness_hist/1"] == {0: 10.0}
    assert not {"flag", "name", "bad", "lens", "staleness_hist"} & set(scalars)
    # the walltime of a step's events is the JSONL line's time
    t0 = read_metrics(tmp_path)[0]["time"]
    assert any(ev.step == 0 and ev.HasField("summary") and abs(ev.wall_time - t0) < 1e-3
               for ev in _events(path))


def test_resume_sets_tensorboard_purge_step(tmp_path):
    from tensorboardX.proto.event_pb2 import SessionLog

    with RunLog(tmp_path) as rl:
        for s in range(5):
            rl.log(s, {"reward_mean": float(s)})
    (first,) = _event_files(tmp_path)
    assert not any(ev.HasField("session_log") for ev in _events(first))
    with RunLog(tmp_path, resume_step=2) as rl:
        rl.log(3, {"reward_mean": 30.0})
    files = _event_files(tmp_path)
    assert len(files) == 2 and files[0] == first  # earlier file kept, name order = time
    assert _scalars(first)["reward_mean"] == {s: float(s) for s in range(5)}
    events = _events(files[1])
    starts = [ev for ev in events if ev.HasField("session_log")]
    assert len(starts) == 1
    assert starts[0].session_log.status == SessionLog.START and starts[0].step == 3
    assert events.index(starts[0]) < min(i for i, ev in enumerate(events)
                                         if ev.HasField("summary"))
    assert _scalars(files[1])["reward_mean"] == {3: 30.0}


# ---- plots ------------------------------------------------------------------------------

def _history(steps: int = 5) -> list[dict]:
    out = []
    for s in range(steps):
        out.append({
            "reward_mean": 0.2 + 0.1 * s, "pass_rate": 0.1 + 0.1 * s,
            "pass_rate/shell-basics": min(1.0, 0.2 * s), "pass_rate/python": 0.1 * s,
            "staleness_mean": 0.4, "staleness_max": 1.0,
            "staleness_hist": {"0": 300 - 10 * s, "1": 100 + 10 * s, "2": 5},
            "rollout_wait_seconds": 1.5, "train_seconds": 6.0 + s, "sync_seconds": 0.4,
            "step_seconds": 9.0 + s, "rollout_tokens_per_s": 800.0 + 20 * s,
            "train_tokens_per_s": 2400.0, **({"eval/pass_rate": 0.3 + 0.05 * s,
                                               "eval/pass_rate/python": 0.2}
                                              if s % 2 == 0 else {}),
        })
    return out


ALL = {"reward", "pass_rate_by_domain", "staleness", "time_split", "throughput", "eval"}


def _is_png(p: Path) -> bool:
    return p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000


def test_plot_run_realistic_history(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as rl:
        for s, m in enumerate(_history()):
            rl.log(s, m)
    paths = plot_run(tmp_path)
    assert set(paths) == ALL
    for name, p in paths.items():
        assert p == tmp_path / "plots" / f"{name}.png" and _is_png(p)
    out = tmp_path / "elsewhere"
    assert set(plot_run(tmp_path, out)) == ALL
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in ALL)


def test_plot_run_nan_single_step_absent_keys(tmp_path):
    one = tmp_path / "one"
    with RunLog(one, tensorboard=False) as rl:
        rl.log(0, _history(1)[0])
    assert set(plot_run(one)) == ALL

    nan = tmp_path / "nan"
    with RunLog(nan, tensorboard=False) as rl:
        for s, m in enumerate(_history(5)):
            if s in (1, 3):
                m = {k: (float("nan") if not isinstance(v, dict) else v) for k, v in m.items()}
            rl.log(s, m)
        rl.log(5, {"reward_mean": float("nan"), "wait_seconds": 2.0})  # the loop's name
    assert set(plot_run(nan)) == ALL

    # only what is there is drawn; all-NaN is as good as absent
    few = tmp_path / "few"
    with RunLog(few, tensorboard=False) as rl:
        rl.log(0, {"reward_mean": 0.5, "train_seconds": 1.0, "eval/pass_rate": math.nan})
        rl.log(1, {"reward_mean": math.nan, "wait_seconds": 2.0})
    assert set(plot_run(few)) == {"reward", "time_split"}

    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot_run(empty) == {}
    assert not (empty / "plots").exists()


# ---- progress line ----------------------------------------------------------------------


def test_format_progress():
    m = {"reward_mean": 0.4213, "pass_rate": 0.375, "staleness_mean": 0.61,
         "step_seconds": 12.34, "rollout_tokens_per_s": 850.2, "train_tokens_per_s": 99.0}
    assert format_progress(9, 10, m) == \
        "reward 0.42 | pass 0.38 | stale 0.6 | 12.3 s/step | 850 tok/s"
    assert format_progress(0, 11, m).endswith("| eta 2m03s")
    assert format_progress(0, 5, {}) == ""
    assert format_progress(0, 5, {"reward_mean": math.nan, "train_tokens_per_s": 12500.0,
                                  "eval/pass_rate": 0.5}) == "eval 0.50 | 12k tok/s"
    assert format_progress(0, 2, {"step_seconds": 4000.0}) == "4000 s/step | eta 1h06m"
