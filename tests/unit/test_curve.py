"""bench/curve.py: a run's learning curve from its metrics lines."""
from __future__ import annotations

import json

import pytest

from bench.curve import curve, main, table

pytestmark = pytest.mark.unit


def lines():
    out = []
    for s in range(6):
        m = {"step": s, "time": 100.0 + 2 * s, "reward_mean": 0.1 * s, "response_len_mean": 50 + s, "samples": 128}
        if s == 0:
            m.update({"wait_s": 3.0, "train_s": 1.0, "val/accuracy_initial": 0.01})
        if s % 3 == 2:
            m["val/accuracy"] = 0.02 * s
        out.append(m)
    return out


def test_curve_times_from_the_first_step_start_and_val_points():
    c = curve(lines())
    assert c["times"][0] == pytest.approx(4.0) and c["times"][-1] == pytest.approx(14.0)
    assert c["val"] == [(0, 0.0, 0.01), (3, pytest.approx(8.0), pytest.approx(0.04)), (6, pytest.approx(14.0),
                                                                                       pytest.approx(0.10))]
    assert c["samples"] == 768
    t = table(c, every=2)
    assert t.splitlines()[0] == "6 steps in 14 s; 54.9 samples/s"
    assert "| 0 | 0 | | | 0.0100 |" in t and "| 3 | 8 | 0.200 | 52 | 0.0400 |" in t
    assert "| 2 | 6 | 0.100 | 51 |  |" in t and "| 1 |" not in t   # every 2nd step, plus validations


def test_a_resumed_run_starts_at_its_first_step():
    ls = [dict(m, step=m["step"] + 50) for m in lines()]
    c = curve(ls)
    assert c["val"][0] == (50, 0.0, 0.01) and c["steps"][0] == 51
    assert "| 50 | 0 | | | 0.0100 |" in table(c, every=5)
    one = curve([{"step": 0, "time": 5.0, "reward_mean": 0.0, "response_len_mean": 1, "samples": 8}])
    assert table(one, every=1).splitlines()[0] == "1 steps in 0 s; samples/s unknown"  # no division by zero


def test_cli_writes_png_and_refuses_an_empty_file(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(m) for m in lines()) + "\n")
    assert main([str(f), "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    f.write_text("")
    assert main([str(f)]) == 2
    assert "no step finished" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(f), "--every", "0"])
