"""The environment `make` builds: a constraints file pins the torch it holds, so that adding a
package (`.venv/bin/pip install -c .venv/constraints.txt timm`) never swaps torch for another build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_make_writes_a_constraints_file_that_pins_the_installed_torch():
    dry = subprocess.run(["make", "-n", "-B", "venv"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    writes = [i for i, line in enumerate(lines) if "constraints.txt" in line and ">" in line]
    installs = [i for i, line in enumerate(lines) if "pip install" in line and "-c .venv/constraints.txt" in line]
    assert writes and installs and writes[0] < installs[0], dry.stdout  # written before the first install using it


def test_the_venv_the_suite_runs_in_pins_its_own_torch():
    prefix = Path(sys.prefix)
    if not (prefix / ".adaptmem-installed").exists():
        pytest.skip("not running in an environment made by `make`")
    pins = (prefix / "constraints.txt").read_text().split()
    assert pins == [f"torch=={torch.__version__}"]
