"""`ridgeline train`: a run directory, checkpoints, `--resume` after a kill, and the
errors a wrong config gets at the start (never a crash mid-run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ridgeline.errors import ConfigError, RidgelineError
from ridgeline.rl import checkpoint
from ridgeline.rl.digits import tiny_policy
from ridgeline.rl.run import TrainConfig, load_train_config, train
from ridgeline.rl.run_log import read_metrics

RIDGELINE = [sys.executable, "-m", "ridgeline.cli"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    a, b = root / "a", root / "b"
    tiny_policy(0).save_pretrained(a)
    tiny_policy(1).save_pretrained(b)
    return a, b


def write_config(path: Path, model: Path, out: Path, **over) -> Path:
    cfg = {"policy": {"model": str(model)}, "tasks": {"source": "shift"}, "steps": 12,
           "out": str(out), "checkpoint_every": 2, "plots": False,
           "trainer": {"lr": 5e-4, "micro_batch_size": 128},
           "loop": {"group_size": 8, "batch_groups": 8, "eta": 1},
           "engine": {"max_num_seqs": 128, "num_kv_blocks": 1024}}
    for k, v in over.items():
        cfg[k] = v
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RIDGELINE, *args], capture_output=True, text=True, timeout=timeout)


def test_kill_mid_run_then_resume_continues_with_no_step_repeated_or_skipped(tmp_path, tiny_models):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "train.yaml", tiny_models[0], out)
    # Slow each step down a little so that the kill lands inside the run.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*RIDGELINE, "train", "--config", str(cfg), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            if proc.poll() is not None:
                pytest.fail(f"the run ended before the kill: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
              if line.strip().endswith("}")]
    assert len(logged) < 12, "the kill came too late to test anything"
    ckpt = checkpoint.find(out)
    assert ckpt is not None
    ckpt_step = json.loads((ckpt / "state.json").read_text())["step"]
    assert ckpt_step % 2 == 1 and ckpt_step <= max(logged)   # every 2nd step (0-based: 1, 3...)

    res = run_cli("train", "--config", str(cfg), "--resume", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(12))                 # none repeated, none skipped
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps_done"] == 12
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 11 and state["version"] == 12
    # the weights go on from the checkpoint: the resumed run's first sync is version ckpt+2
    resumed = read_metrics(out)[ckpt_step + 1]
    assert resumed["version"] == ckpt_step + 2
    # two TensorBoard event files: the first run's and the resumed one's (with a purge step)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_resume_restores_trainer_buffer_and_task_order(tmp_path, tiny_models):
    out = tmp_path / "run"
    cfg = TrainConfig.model_validate(yaml.safe_load(
        write_config(tmp_path / "t.yaml", tiny_models[0], out, steps=4).read_text()))
    first = train(cfg)
    assert first.steps_done == 4
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    ck = checkpoint.load(out, None)
    assert ck.step == 3 and ck.trainer["num_steps"] >= 1 and ck.trainer["version"] == 4
    # draws handed out but never trained on are handed out again first
    assert state["sampler"]["next"] >= 4 * 8
    # the checkpoint is a model directory `ridgeline eval --model` loads, holding the
    # trained weights
    from safetensors.torch import load_file

    from ridgeline.engine.model_executor.registry import resolve_model

    assert resolve_model(str(out / "checkpoint")).format == "hf"
    saved = load_file(str(out / "checkpoint" / "model.safetensors"))
    for name, tensor in ck.trainer["model"].items():
        assert torch.equal(saved[name], tensor), name
    resumed = train(cfg.model_copy(update={"steps": 6}), resume=True)
    assert resumed.steps_done == 6
    assert [m["step"] for m in read_metrics(out)] == list(range(6))


def cli(capsys, *args: str) -> tuple[int, str]:
    """`ridgeline ...` in this process (exit code, stderr): user mistakes exit 2."""
    from ridgeline.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def test_a_run_dir_holding_a_run_needs_resume_and_refuses_another_model(tmp_path, tiny_models,
                                                                        capsys):
    out = tmp_path / "run"
    a = write_config(tmp_path / "a.yaml", tiny_models[0], out, steps=2)
    assert cli(capsys, "train", "--config", str(a), "--json")[0] == 0
    code, err = cli(capsys, "train", "--config", str(a))
    assert code == 2 and "--resume" in err
    b = write_config(tmp_path / "b.yaml", tiny_models[1], out, steps=4)
    code, err = cli(capsys, "train", "--config", str(b), "--resume")
    assert code == 2 and "another model" in err and "Traceback" not in err
    assert [m["step"] for m in read_metrics(out)] == [0, 1]     # nothing was appended


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_models):
    cfg = write_config(tmp_path / "t.yaml", tiny_models[0], tmp_path / "nothing")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        train(load_train_config(cfg), resume=True)


def test_a_missing_model_fails_at_the_start(tmp_path, capsys):
    cfg = write_config(tmp_path / "t.yaml", tmp_path / "no-such-model", tmp_path / "run")
    code, err = cli(capsys, "train", "--config", str(cfg))
    assert code == 2 and "Traceback" not in err and "no-such-model" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tasks_that_all_fail_their_quality_check_fail_at_the_start(tmp_path, tiny_models):
    suite = tmp_path / "suite"
    task = suite / "broken-oracle"
    (task / "tests").mkdir(parents=True)
    (task / "task.yaml").write_text("instruction: Create /app/out.\ndifficulty: easy\n"
                                    "category: shell-basics\nparser_name: pytest\n")
    (task / "solution.sh").write_text("#!/bin/bash\ntrue\n")      # does not solve it
    builtin = Path(__file__).parents[2] / "src/ridgeline/tasks/builtin/create-directory"
    (task / "run-tests.sh").write_text((builtin / "run-tests.sh").read_text())
    (task / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\ndef test_out():\n    assert Path('/app/out').exists()\n")
    cfg = write_config(tmp_path / "t.yaml", tiny_models[0], tmp_path / "run",
                       tasks={"source": str(suite)})
    with pytest.raises(ConfigError, match="every training task failed its quality check"):
        train(load_train_config(cfg))


def test_unknown_task_ids_and_an_overlapping_split_are_errors(tmp_path, tiny_models):
    cfg = write_config(tmp_path / "t.yaml", tiny_models[0], tmp_path / "run",
                       tasks={"source": "builtin", "ids": ["no-such-task"], "check": False})
    with pytest.raises(ConfigError, match="no-such-task"):
        train(load_train_config(cfg))
    cfg = write_config(tmp_path / "u.yaml", tiny_models[0], tmp_path / "run",
                       tasks={"source": "builtin", "ids": ["hello-file"],
                              "eval_ids": ["hello-file"], "check": False})
    with pytest.raises(ConfigError, match="held out"):
        train(load_train_config(cfg))


def test_a_sandbox_backend_that_cannot_start_fails_at_the_start(tmp_path, tiny_models):
    cfg = write_config(tmp_path / "t.yaml", tiny_models[0], tmp_path / "run",
                       rollout={"backend": "no-such-backend"})
    with pytest.raises(RidgelineError, match="no-such-backend"):
        train(load_train_config(cfg))


def test_config_typos_name_the_field(tmp_path, tiny_models, capsys):
    cfg = write_config(tmp_path / "t.yaml", tiny_models[0], tmp_path / "run",
                       loop={"group_sise": 4})
    code, err = cli(capsys, "train", "--config", str(cfg))
    assert code == 2 and "group_sise" in err


@pytest.mark.parametrize("section, message", [
    ({"trainer": {"temperature": 0.7}}, "differs from rollout.temperature"),
    ({"rollout": {"top_p": 0.9}}, "top_p"),
])
def test_sampling_the_trainer_cannot_reproduce_is_refused(tmp_path, section, message):
    """The trainer's logprobs must be of the distribution the rollouts sampled: another
    temperature, or a nucleus filter, is refused with the field named (it used to be
    replaced silently, or accepted)."""
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(section))
    with pytest.raises(ConfigError, match=message):
        load_train_config(path)
    # the same temperature in both places is fine
    path.write_text(yaml.safe_dump({"trainer": {"temperature": 0.7},
                                    "rollout": {"temperature": 0.7}}))
    assert load_train_config(path).trainer.temperature == 0.7


def test_a_checkpoint_written_with_the_old_episode_names_still_resumes(tmp_path, monkeypatch):
    """Buffer groups pickled before `EpisodeRecord` became `EpisodeOutcome` (and a group's
    `records` its `outcomes`) load as today's types."""
    import ridgeline.rl.filters as filters
    from ridgeline.rl.rollouts import EpisodeGroup
    from ridgeline.rl.tokens import TokenEpisode

    class EpisodeRecord:  # the old class, pickled under its old name
        pass

    EpisodeRecord.__module__ = "ridgeline.rl.filters"
    EpisodeRecord.__qualname__ = "EpisodeRecord"
    monkeypatch.setattr(filters, "EpisodeRecord", EpisodeRecord, raising=False)
    tokens = TokenEpisode.start([1, 2])
    old = EpisodeRecord()
    old.__dict__.update(vars(filters.EpisodeOutcome(reward=1.0, sample=tokens)))
    group = EpisodeGroup.__new__(EpisodeGroup)
    group.__dict__.update(task="t", samples=[tokens], records=[old], seconds=1.0, index=7,
                          tokens=0)
    path = tmp_path / checkpoint.NAME
    path.mkdir()
    torch.save({"trainer": {}, "buffer": {"ready": [{"group": group}]}, "rng": {}},
               path / "trainer.pt")
    (path / "state.json").write_text(json.dumps({"format": checkpoint.FORMAT, "step": 3}))
    monkeypatch.delattr(filters, "EpisodeRecord")
    loaded = checkpoint.load(tmp_path).buffer["ready"][0]["group"]
    assert isinstance(loaded.outcomes[0], filters.EpisodeOutcome) and loaded.index == 7
    assert loaded.outcomes[0].reward == 1.0 and loaded.samples[0].token_ids == [1, 2]
