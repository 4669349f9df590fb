"""The building-block training families (catalog/building_blocks.py): every one passes its
quality check, and no training family is a held-out family under another name."""

from __future__ import annotations

import re
import shutil

import pytest

from ridgeline.tasks.families import families, generate
from ridgeline.tasks.families.catalog import building_blocks
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

BLOCKS = [f for f in families() if f.make.__module__ == building_blocks.__name__]
SEEDS = range(8)


def test_the_building_blocks_are_training_families_that_name_what_they_support():
    assert len(BLOCKS) >= 12
    assert {f.split for f in BLOCKS} == {"train"}
    heldout = {f.name for f in families("heldout")}
    for fam in BLOCKS:
        doc = fam.make.__doc__ or ""
        assert heldout & set(re.findall(r"`([a-z0-9-]+)`", doc)), \
            f"{fam.name}: the docstring must name the held-out family it supports"


@needs_bwrap
def test_each_building_block_family_passes_its_quality_check(tmp_path):
    """Seeds 0 and 1: the oracle passes, the untouched workspace fails."""
    result = generate(BLOCKS, [0, 1], tmp_path, concurrency=4)
    assert result.excluded == {}
    assert len(result.tasks) == 2 * len(BLOCKS)


_VOCAB = re.compile(r"\b(" + "|".join(sorted({re.escape(w) for w in NOUNS + NAMES + SERVICES},
                                             key=len, reverse=True)) + r")\b", re.I)


def _template(instruction: str) -> str:
    """An instruction with its drawn values (paths, quoted values, words, numbers)
    replaced by placeholders: what stays is the wording of the goal."""
    t = re.sub(r"/app/\S*", "<path>", instruction)
    t = re.sub(r"`[^`]*`", "<code>", t)
    t = re.sub(r"\"[^\"]*\"", "<str>", t)
    t = _VOCAB.sub("<word>", t)
    t = re.sub(r"\d+(\.\d+)?", "<n>", t)
    return " ".join(t.split()).lower()


def _skeleton(solution: str) -> str:
    """An oracle with file names, drawn words and numbers replaced: its commands."""
    t = re.sub(r"[\w./-]*\w\.\w+\b", "<file>", solution)
    t = _VOCAB.sub("<word>", t)
    t = re.sub(r"\d+", "<n>", t)
    return " ".join(t.split())


def _made(split: str) -> dict[str, list]:
    return {f.name: [f.instance(s) for s in SEEDS] for f in families(split)}


def test_no_training_family_is_a_renamed_held_out_family():
    train, heldout = _made("train"), _made("heldout")
    assert not set(train) & set(heldout)
    descriptions = {f.description for f in families("heldout")}
    assert not [f.name for f in families("train") if f.description in descriptions]
    seen: dict[str, str] = {}
    for name, insts in heldout.items():
        for inst in insts:
            seen[_template(inst.instruction)] = name
            seen[_skeleton(inst.solution)] = name
    for name, insts in train.items():
        for inst in insts:
            for key in (_template(inst.instruction), _skeleton(inst.solution)):
                assert key not in seen, f"training {name} repeats held-out {seen[key]}: {key}"
