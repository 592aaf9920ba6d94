"""learner/metric_names.py: the one table of metric names, its old-name mapping and the docs' copy."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from learner import metric_names as M

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"


def test_every_name_is_grouped_once_with_a_one_line_meaning():
    assert all(m.name == M.STEP or m.group in M.GROUPS for m in M.TABLE.values())
    assert all(m.meaning and "\n" not in m.meaning and "|" not in m.meaning for m in M.TABLE.values())
    assert {g for g in (m.group for m in M.TABLE.values()) if g} == set(M.GROUPS)  # no empty group
    with pytest.raises(ValueError, match="defined twice"):
        M._m(M.LOSS, "again")
    with pytest.raises(ValueError, match="group is not one of"):
        M.Metric("loss", "ungrouped", None)


def test_old_names_map_one_to_one_onto_the_table():
    olds = [m.old for m in M.TABLE.values() if m.old is not None]
    assert len(olds) == len(set(olds))
    assert set(M.OLD_NAMES.values()) <= M.TABLE.keys()
    # an old name that is some other metric's new name would be renamed away from it
    assert not set(M.OLD_NAMES) & M.TABLE.keys()
    assert set(M.PUBLISHER_STATS.values()) <= M.TABLE.keys()


def test_the_docs_list_the_table_and_only_its_names():
    assert M.markdown() in METRICS_DOC.read_text(), \
        "docs/metrics.md's table differs from learner/metric_names.py: paste M.markdown()"
    # any `group/name` the README or a docs page mentions is a name of the table
    groups = "|".join(M.GROUPS)
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        mentioned = set(re.findall(rf"`((?:{groups})/[a-z_]+)[`:]", doc.read_text()))
        assert mentioned <= M.TABLE.keys(), (doc.name, mentioned - M.TABLE.keys())
    assert re.findall(rf"`((?:{groups})/[a-z_]+)[`:]", (ROOT / "README.md").read_text())
