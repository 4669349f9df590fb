"""Task families: generators of verifiable tasks, each instance quality-checked."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from typer.testing import CliRunner

from ridgeline.errors import ConfigError, TaskError
from ridgeline.tasks.families import SKILLS, Instance, TaskFamily, families, generate
from ridgeline.tasks.families.base import fingerprint
from ridgeline.tasks.loader import load_tasks

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def test_there_are_twenty_families_over_both_splits_and_every_skill():
    fams = families()
    assert len(fams) >= 20
    train = {f.skill for f in families("train")}
    heldout = {f.skill for f in families("heldout")}
    assert heldout <= train, "a held-out family needs the skill from a training family"
    assert train | heldout == set(SKILLS)
    assert {f.instance(0).difficulty for f in fams} >= {"easy", "medium"}


@pytest.mark.parametrize("fam", families(), ids=lambda f: f.name)
def test_a_seed_gives_one_instance_and_seeds_differ(fam: TaskFamily):
    made = [fam.instance(s) for s in range(8)]
    assert fingerprint(fam.instance(3)) == fingerprint(made[3])
    prints = {fingerprint(inst) for inst in made}
    assert len(prints) >= 6, f"{fam.name}: 8 seeds gave {len(prints)} distinct instances"
    phrasings = {inst.instruction.split("/app/")[0] for inst in made}
    assert len(phrasings) >= 2, f"{fam.name}: one phrasing of the goal only"


def _toy(instruction: str, solution: str) -> TaskFamily:
    tests = ('from pathlib import Path\n\n\ndef test_done():\n'
             '    assert Path("/app/out.txt").read_text() == "42\\n"\n')
    return TaskFamily("toy", "text", "train",
                      lambda rng: Instance(instruction, {"in.txt": "x\n"}, solution, tests))


def test_an_instruction_that_gives_the_command_away_is_refused():
    fam = _toy("Run `echo 42 > out.txt` please.", "echo 42 > out.txt\n")
    with pytest.raises(TaskError, match="contains the oracle's command"):
        fam.instance(0)


@needs_bwrap
def test_every_family_passes_its_quality_check(tmp_path):
    """Seed 0 of every family: the oracle passes, the untouched workspace fails (the
    slow suite checks more seeds)."""
    result = generate(families(), [0], tmp_path)
    assert result.excluded == {}
    tasks = load_tasks(tmp_path)
    assert {t.id for t in tasks} == {f"{f.name}-0" for f in families()}
    assert all("generated" in t.tags and t.instruction for t in tasks)


@pytest.mark.slow
@needs_bwrap
def test_every_family_passes_its_quality_check_on_many_seeds(tmp_path):
    result = generate(families(), range(1, 9), tmp_path)
    assert result.excluded == {}


@needs_bwrap
def test_an_instance_whose_oracle_fails_is_left_out_with_its_reason(tmp_path):
    broken = _toy("Write the answer to the question in /app/out.txt.", "echo 41 > out.txt\n")
    result = generate([broken], [0, 1], tmp_path)
    assert result.tasks == [] and set(result.excluded) == {"toy-0", "toy-1"}
    assert any("oracle" in r for r in result.excluded["toy-0"])
    assert not (tmp_path / "toy-0").exists()


def test_the_cli_lists_and_writes_families(tmp_path):
    from ridgeline.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["tasks", "families", "--split", "heldout", "--json"])
    assert listed.exit_code == 0
    rows = json.loads(listed.stdout)
    assert rows and {r["split"] for r in rows} == {"heldout"}
    name = rows[0]["name"]
    made = runner.invoke(app, ["tasks", "generate", str(tmp_path), "-f", name, "-n", "2",
                               "--seed", "5", "--no-check"])
    assert made.exit_code == 0, made.output
    assert [t.id for t in load_tasks(tmp_path)] == [f"{name}-5", f"{name}-6"]
    meta = json.loads((tmp_path / f"{name}-5" / "family.json").read_text())
    assert meta["split"] == "heldout" and meta["seed"] == 5
    bad = runner.invoke(app, ["tasks", "families", "--split", "test"])
    assert isinstance(bad.exception, ConfigError) and "train or heldout" in str(bad.exception)


def test_generation_is_independent_of_the_global_random_state():
    fam = families()[0]
    random.seed(1)
    a = fingerprint(fam.instance(2))
    random.seed(2)
    assert fingerprint(fam.instance(2)) == a
