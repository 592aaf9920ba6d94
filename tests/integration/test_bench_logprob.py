"""bench/logprob.py runs on CPU, and the chunked head trains to the same loss as plain logits."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_logprob_bench_runs_on_cpu_and_the_paths_agree(tmp_path, capsys):
    from bench.logprob import main

    out = tmp_path / "lp.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--chunks", "0,3", "--rows", "4", "--prompt", "8",
                 "--response", "2-10", "--steps", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [r["chunk"] for r in res] == [0, 3]
    assert res[0]["losses"] == pytest.approx(res[1]["losses"], rel=1e-5)
    assert all(r["raw_head_s"] > 0 and r["response_tokens"] < r["positions"] for r in res)
    assert "| 3 |" in capsys.readouterr().out
