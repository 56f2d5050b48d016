"""Compiling the Python in Spark's zips: real zips, imported by a real interpreter through zipimport."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from airflow_stream_provider.runtime.precompile import main, precompile


def _zip(tmp_path):
    path = tmp_path / "lib" / "pyspark.zip"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("pkg/__init__.py", "VALUE = 41\n")
        archive.writestr("pkg/mod.py", "from pkg import VALUE\n\ndef answer():\n    return VALUE + 1\n")
        archive.writestr("pkg/tests/test_mod.py", "def test(): pass\n")
        archive.writestr("pkg/py2only.py", "print 'a statement'\n")
    return path


def _import(path) -> str:
    code = "import pkg.mod, sys; print(pkg.mod.answer(), pkg.mod.__file__)"
    return subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(path)}, capture_output=True,
                          text=True, check=True).stdout


def test_modules_get_their_compiled_form_beside_them_and_zipimport_uses_it(tmp_path):
    path = _zip(tmp_path)
    assert _import(path).split() == ["42", f"{path}/pkg/mod.py"]
    assert precompile(path) == 2
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
    assert {"pkg/__init__.pyc", "pkg/mod.pyc"} <= names
    assert "pkg/tests/test_mod.pyc" not in names, "Spark's own tests are never imported"
    assert "pkg/py2only.pyc" not in names and "pkg/py2only.py" in names, "a module this Python cannot compile"
    assert _import(path).split() == ["42", f"{path}/pkg/mod.pyc"]
    assert precompile(path) == 0, "a compiled zip is left as it is"


def test_the_command_names_what_it_compiled(tmp_path, capsys):
    path = _zip(tmp_path)
    assert main([str(path)]) == 0
    assert f"{path}: 2 modules compiled for Python {sys.version_info[0]}.{sys.version_info[1]}" in capsys.readouterr().out
