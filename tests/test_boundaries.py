"""The architecture's two sides, checked on the source: the runtime never imports Airflow, the Airflow
side never imports PySpark, and the shared modules import neither.  Plus ruff, so lint stays clean."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "airflow_stream_provider"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _sources(root: Path):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _sources(PACKAGE / "runtime") + _sources(REPO / "spark_jobs")
                         + _sources(REPO / "benchmarks" / "jobs"),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_side_never_imports_airflow(path):
    assert "airflow" not in _imports(path)


@pytest.mark.parametrize("path", [p for p in _sources(PACKAGE) if "runtime" not in p.parts]
                         + _sources(REPO / "dags")
                         + [p for p in _sources(REPO / "benchmarks") if "jobs" not in p.parts],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_airflow_side_never_imports_pyspark(path):
    assert "pyspark" not in _imports(path)


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
