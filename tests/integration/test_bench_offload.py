"""bench/offload.py runs on CPU (the GPU command is the same with --device cuda --shape 1.5b), and its
loss comparison fails when the numbers differ."""
from __future__ import annotations

import json

import pytest

from bench.offload import BF16_RTOL, compare, main

pytestmark = pytest.mark.integration


def test_offload_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "offload.json"
    assert main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--rows", "4", "--row-len", "48",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in res] == ["off", "optimizer", "param", "both"]
    ref = res[0]["losses"]
    assert ref[1] < ref[0]  # the optimizer step really moved the weights
    for r in res:
        assert r["losses"] == pytest.approx(ref, rel=1e-6)  # on CPU offload moves nothing: same numbers
    assert "| param |" in capsys.readouterr().out


def test_compare_flags_diverging_losses():
    rows = compare([{"mode": "off", "losses": [10.0, 9.0]}, {"mode": "param", "losses": [10.0, 9.0 * (1 + 3 * BF16_RTOL)]}])
    assert rows[0]["losses_match"] and not rows[1]["losses_match"]
