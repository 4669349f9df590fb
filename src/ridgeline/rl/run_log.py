"""The run directory of an RL training run: per-step metrics, TensorBoard events, plots.

    run_dir/
      metrics.jsonl   one JSON object per training step: {"step", "time", **metrics}
      tensorboard/    tensorboardX event files (`tensorboard --logdir run_dir/tensorboard`)
      plots/          PNGs drawn from metrics.jsonl by `run_plots.plot_run` (reward, pass rates,
                      staleness, time split, throughput, sampler/trainer mismatch, held-out eval)
      checkpoint/     written by the checkpointing module, not by this one

    with RunLog(run_dir) as run:               # a new run (refuses a used directory)
        for step, metrics in ...: run.log(step, metrics)
    RunLog(run_dir, resume_step=k)             # after restoring the checkpoint of step k

`metrics.jsonl` is the record of the run; TensorBoard is a view of it. Every line is
flushed and `os.fsync`ed before `log` returns, so a run that is killed (OOM, preemption,
Ctrl-C) loses no step it logged; at worst the line being written is torn, and readers
drop a torn last line. Steps must be strictly increasing.

Resuming: a checkpoint is taken after some step k, but the run may have gone on logging
steps k+1.. before it died. Those steps run again after the restore, so
`RunLog(run_dir, resume_step=k)` keeps the lines with step <= k, drops every later line
and a torn one (rewriting the file atomically: temp file, fsync, `os.replace`), accepts
only steps > k from then on, and opens TensorBoard with `purge_step=k+1` (a SessionLog
START at step k+1, on which TensorBoard discards the superseded events of the earlier
files). Opening a directory whose metrics.jsonl already has lines *without* resume_step
is refused: two runs are never mixed in one file. Log step k before writing checkpoint k,
or a kill between the two loses step k's line.

Values: numbers, strings, None, and dicts/lists of them (numpy and torch scalars are
converted). Non-finite floats (NaN, inf) are written as JSON `null`, so the file is
strict JSON (jq, other languages); readers get None back. TensorBoard receives every
finite int/float (not bool) as a scalar under its key as given (`reward_mean`,
`pass_rate/shell-basics`), and a dict of numbers as one scalar per entry under
`key/subkey` -- in particular the histogram `staleness_hist`, {"0": tokens, "1": tokens,
...} (policy versions of lag -> number of trained tokens; JSON keys are strings), becomes
`staleness_hist/0`, `staleness_hist/1`, ... Lists and strings go to the JSONL only.

Metric keys `plot_run` and `format_progress` understand: reward_mean, pass_rate,
pass_rate/<domain>, staleness_mean, staleness_hist, rollout_wait_seconds (or
wait_seconds), train_seconds, sync_seconds, step_seconds, rollout_tokens_per_s,
train_tokens_per_s, eval/pass_rate and eval/pass_rate/<domain>; the trainer's sampler/
trainer mismatch (every step: mismatch/kl_k3, mismatch/kl_k1, mismatch/log_ppl_ratio) and
the share of tokens its rollout correction truncated or masked (behaviour_weight_capped,
behaviour_weight_masked), plotted together as `mismatch`.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypeGuard

from ridgeline.errors import ConfigError, NotFoundError
from ridgeline.rl.protocols import JSONValue

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"
RESERVED = ("step", "time")

#: One line of metrics.jsonl, as read back.
MetricsRecord = dict[str, JSONValue]


# ---- values -----------------------------------------------------------------------------

def _jsonable(value: object, key: str) -> JSONValue:
    """`value` as plain JSON data; non-finite floats become None."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _jsonable(float(value), key)
    item = getattr(value, "item", None)  # numpy / torch scalars (0-d tensors)
    if callable(item):
        try:
            return _jsonable(item(), key)
        except (ValueError, RuntimeError, TypeError):
            pass
    raise TypeError(f"metric {key!r}: a {type(value).__name__} cannot be written as JSON "
                    f"(use a number, string, None, or a dict/list of them)")


def is_number(v: object) -> TypeGuard[int | float]:
    """An int or float, not a bool (JSON numbers as metrics hold them)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def flatten_scalars(metrics: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    """The TensorBoard view of one record: tag -> finite number. Dicts nest as
    `key/subkey`; bools, strings, lists, None and non-finite values are left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        tag = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_scalars(v, f"{tag}/"))
        elif is_number(v) and math.isfinite(v):
            out[tag] = v
    return out


# ---- reading ----------------------------------------------------------------------------

def _load(path: Path) -> tuple[list[tuple[MetricsRecord, str]], bool]:
    """(record, raw line) pairs of a metrics file, and whether a torn last line was
    dropped. A bad line anywhere but last is corruption and raises ConfigError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    lines = data.split(b"\n")
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    out: list[tuple[MetricsRecord, str]] = []
    torn = False
    for idx, (lineno, raw) in enumerate(numbered):
        rec = None
        try:
            text = raw.decode("utf-8")
            rec = json.loads(text)
        except (UnicodeDecodeError, ValueError):
            pass
        ok = (isinstance(rec, dict) and isinstance(rec.get("step"), int)
              and not isinstance(rec.get("step"), bool))
        if ok:
            out.append((rec, text.strip()))
        elif idx == len(numbered) - 1:
            torn = True  # the process was killed while writing it
            log.warning("%s: dropping a torn last line (%d bytes)", path, len(raw))
        else:
            raise ConfigError(f"{path} line {lineno} is not a metrics record",
                              hint="the file is corrupt; repair or remove that line")
    return out, torn


def read_metrics(run_dir: Path | str) -> list[MetricsRecord]:
    """Every logged step of a run, in file order (a torn last line is left out; an
    absent metrics.jsonl is an empty run). Non-finite values read back as None."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotFoundError(f"run directory {run_dir} does not exist",
                            hint="pass the directory `ridgeline train` wrote")
    return [rec for rec, _ in _load(run_dir / METRICS_FILE)[0]]


# ---- writing ----------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class RunLog:
    """Appends per-step metrics to `run_dir/metrics.jsonl` (fsynced) and TensorBoard.

    `resume_step=k`: continue a run restored from the checkpoint of step k (lines after
    k are dropped, TensorBoard purges from k+1). `resume_step=None`: a new run; a
    directory that already holds logged steps is refused. One process writes a run
    directory at a time."""

    def __init__(self, run_dir: Path | str, *, resume_step: int | None = None,
                 tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.tensorboard_dir = self.run_dir / TENSORBOARD_DIR
        if resume_step is not None and (isinstance(resume_step, bool)
                                        or not isinstance(resume_step, int)
                                        or resume_step < 0):
            raise ConfigError(f"resume_step must be a step number >= 0, not {resume_step!r}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._last_step: int | None = None
        if resume_step is None:
            if self._has_content():
                raise ConfigError(
                    f"{self.metrics_path} already holds the metrics of a run",
                    hint="pass --resume to continue it from its checkpoint, or choose a "
                         "new run directory")
        else:
            self._truncate(resume_step)
            self._last_step = resume_step
        existed = self.metrics_path.exists()
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if not existed:
            _fsync_dir(self.run_dir)
        self._writer = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:  # pragma: no cover - a declared dependency
                self._file.close()
                raise ConfigError("tensorboardX is not installed",
                                  hint="install it, or pass tensorboard=False") from e
            # Event files are named by the second they were opened in and opened with
            # "wb": a zero-padded nanosecond suffix keeps a resumed run that starts in
            # the same second from overwriting the earlier file, and keeps name order
            # (which TensorBoard reads in) chronological.
            self._writer = SummaryWriter(
                logdir=str(self.tensorboard_dir),
                purge_step=None if resume_step is None else resume_step + 1,
                flush_secs=10, filename_suffix=f".{time.time_ns():020d}")

    @property
    def last_step(self) -> int | None:
        """The last step logged (after a resume: resume_step until a step is logged)."""
        return self._last_step

    def _has_content(self) -> bool:
        try:
            with open(self.metrics_path, "rb") as f:
                return any(line.strip() for line in f)
        except FileNotFoundError:
            return False

    def _truncate(self, resume_step: int) -> None:
        records, torn = _load(self.metrics_path)
        keep = [(rec, raw) for rec, raw in records if rec["step"] <= resume_step]
        dropped = len(records) - len(keep)
        if keep and keep[-1][0]["step"] < resume_step:
            log.warning("%s: resuming at step %d but the last logged step is %d; the "
                        "steps between were not logged", self.metrics_path, resume_step,
                        keep[-1][0]["step"])
        if not self.metrics_path.exists():
            return
        text = "".join(raw + "\n" for _, raw in keep)
        if not dropped and not torn and self.metrics_path.read_text("utf-8",
                                                                    "replace") == text:
            return
        if dropped:
            log.info("%s: dropped %d lines after step %d (they run again)",
                     self.metrics_path, dropped, resume_step)
        tmp = self.metrics_path.with_name(METRICS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.metrics_path)
        _fsync_dir(self.run_dir)

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        """Append step's metrics (durable when this returns) and write its scalars to
        TensorBoard. A `step` entry in metrics (AsyncRLLoop puts one) must equal `step`
        and is not repeated; `time` is reserved."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ConfigError(f"step must be an integer >= 0, not {step!r}")
        step = int(step)
        body: MetricsRecord = {}
        for k, v in metrics.items():
            if not isinstance(k, str):
                raise TypeError(f"metric names must be strings, not {k!r}")
            if k == "step":
                if (isinstance(v, bool) or not isinstance(v, numbers.Real)
                        or float(v) != step):
                    raise ConfigError(f"metrics['step'] is {v!r} but the step logged is {step}",
                                      hint="drop the 'step' entry or make it match")
                continue
            if k == "time":
                raise ConfigError("'time' is a reserved metric name (the log adds the "
                                  "wall-clock time itself)", hint="rename the metric")
            body[k] = _jsonable(v, k)
        with self._lock:
            if self._file is None:
                raise ValueError("the run log is closed")
            if self._last_step is not None and step <= self._last_step:
                raise ConfigError(
                    f"step {step} is not after the last logged step {self._last_step}",
                    hint="steps must be strictly increasing; to redo steps, resume from "
                         "a checkpoint (resume_step)")
            now = time.time()
            line = json.dumps({"step": step, "time": now, **body}, allow_nan=False,
                              separators=(",", ":"))
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._last_step = step
            if self._writer is not None:
                for tag, value in flatten_scalars(body).items():
                    self._writer.add_scalar(tag, value, step, walltime=now)
                self._writer.flush()

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- progress line ----------------------------------------------------------------------

def _finite(metrics: Mapping[str, object], key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if is_number(v) and math.isfinite(v) else None


def _rate(x: float) -> str:
    if abs(x) >= 1e6:
        return f"{x / 1e6:.1f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.0f}k"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_progress(step: int, total: int, metrics: Mapping[str, object]) -> str:
    """One line for a progress bar's postfix, e.g.
    `reward 0.42 | pass 0.38 | stale 0.6 | 12.3 s/step | 850 tok/s | rss 3.1G | eta 39m48s`.

    reward = reward_mean, pass = pass_rate, eval = eval/pass_rate, stale =
    staleness_mean (policy versions), s/step = step_seconds, tok/s = rollout (generation)
    tokens per second, else training tokens per second, rss = memory/rss_gb (the
    process's resident memory after the train step). `step` is the step just
    finished, counted from 0 as `AsyncRLLoop.run` passes it, out of `total`; the ETA is
    the remaining steps at this step's pace. Absent and non-finite values are left out."""
    parts = []
    for key, label, fmt in (("reward_mean", "reward", "{:.2f}"), ("pass_rate", "pass", "{:.2f}"),
                            ("eval/pass_rate", "eval", "{:.2f}"),
                            ("staleness_mean", "stale", "{:.1f}")):
        v = _finite(metrics, key)
        if v is not None:
            parts.append(f"{label} {fmt.format(v)}")
    secs = _finite(metrics, "step_seconds")
    if secs is not None:
        parts.append(f"{secs:.1f} s/step" if secs < 100 else f"{secs:.0f} s/step")
    tps = _finite(metrics, "rollout_tokens_per_s")
    if tps is None:
        tps = _finite(metrics, "train_tokens_per_s")
    if tps is not None:
        parts.append(f"{_rate(tps)} tok/s")
    rss = _finite(metrics, "memory/rss_gb")
    if rss is not None:
        parts.append(f"rss {rss:.1f}G")
    remaining = total - step - 1
    if secs is not None and remaining > 0:
        parts.append(f"eta {_duration(secs * remaining)}")
    return " | ".join(parts)
