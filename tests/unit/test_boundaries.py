"""The architecture's two sides, checked on the source: the runtime never imports Airflow, the Airflow
side never imports PySpark, and the shared modules import neither.  Plus ruff, so lint stays clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.sources import PACKAGE, REPO, sources, top_level_imports


@pytest.mark.parametrize("path", sources(PACKAGE / "runtime") + sources(REPO / "spark_jobs")
                         + sources(REPO / "benchmarks" / "jobs"),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_side_never_imports_airflow(path):
    assert "airflow" not in top_level_imports(path)


@pytest.mark.parametrize("path", [p for p in sources(PACKAGE) if "runtime" not in p.parts]
                         + sources(REPO / "dags") + sources(REPO / "stack") + sources(REPO / "demo")
                         + [p for p in sources(REPO / "benchmarks") if "jobs" not in p.parts],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_airflow_side_never_imports_pyspark(path):
    assert "pyspark" not in top_level_imports(path)


@pytest.mark.parametrize("path", sources(REPO / "stack"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_stack_imports_neither_airflow_nor_pyspark_itself(path):
    """It starts both as processes; the provider's driver hook is its one way into Airflow."""
    assert not {"airflow", "pyspark"} & top_level_imports(path)


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
