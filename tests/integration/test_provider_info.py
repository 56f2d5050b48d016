"""The package registers itself with Airflow: everything it lists imports, it lists every hook, operator,
sensor and trigger module on disk, and its connection forms reach Airflow without the FAB provider."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

from airflow_stream_provider.get_provider_info import get_provider_info, ui_field_behaviour


def test_airflow_discovers_the_provider():
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-stream-provider" in manager.providers
    hooks = manager.hooks
    for conn_type in ("stream_state", "stream_kafka", "stream_checkpoint"):
        assert conn_type in hooks, f"connection type {conn_type} is not registered"


def test_every_listed_module_imports():
    info = get_provider_info()
    for section in ("hooks", "operators", "sensors", "triggers"):
        for entry in info[section]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for conn in info["connection-types"]:
        module, _, name = conn["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook.conn_type == conn["connection-type"]
    from airflow.plugins_manager import AirflowPlugin

    plugins = {e.name: e for e in importlib.metadata.entry_points(group="airflow.plugins")
               if e.value.startswith("airflow_stream_provider.")}
    assert set(plugins) == {"stream_status"}, plugins
    cls = plugins["stream_status"].load()
    assert issubclass(cls, AirflowPlugin) and cls.name == "stream_status"


# -- provider info against the modules on disk ---------------------------------------------------------
_SECTIONS = ("hooks", "operators", "sensors", "triggers")


def _kind(cls: type) -> str | None:
    """The provider-info section of a public, non-abstract hook, operator, sensor or trigger class."""
    from airflow.sdk import BaseHook, BaseOperator, BaseSensorOperator
    from airflow.triggers.base import BaseTrigger

    if cls.__name__.startswith("_") or inspect.isabstract(cls):
        return None
    for base, section in ((BaseHook, "hooks"), (BaseSensorOperator, "sensors"), (BaseOperator, "operators"),
                          (BaseTrigger, "triggers")):
        if issubclass(cls, base):
            return section
    return None


def modules_on_disk(package: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(required, allowed): section -> modules under ``<package>.{hooks,operators,sensors,triggers}``.

    *allowed* holds every module that defines (not imports) a class of the section.  *required* leaves
    out the modules whose classes of the section are all bases of classes in other modules (such as
    ``operators/base.py``): a DAG author uses the subclasses, and provider info lists those."""
    defined: list[tuple[str, str, type]] = []
    for folder in _SECTIONS:
        parent = importlib.import_module(f"{package}.{folder}")
        for info in pkgutil.iter_modules(parent.__path__):
            name = f"{parent.__name__}.{info.name}"
            module = importlib.import_module(name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == name and (kind := _kind(cls)):
                    defined.append((kind, name, cls))
    required: dict[str, set[str]] = {section: set() for section in _SECTIONS}
    allowed: dict[str, set[str]] = {section: set() for section in _SECTIONS}
    for kind, name, cls in defined:
        allowed[kind].add(name)
        if not any(issubclass(other, cls) and where != name for _, where, other in defined):
            required[kind].add(name)
    return required, allowed


def listed_modules(info: dict) -> dict[str, set[str]]:
    return {section: {m for entry in info.get(section, []) for m in entry["python-modules"]}
            for section in _SECTIONS}


def test_provider_info_lists_the_modules_on_disk():
    """Every module with a hook, operator, sensor or trigger is listed in its section, and every listed
    module exists and defines one: adding an operator module without registering it fails here."""
    listed = listed_modules(get_provider_info())
    for section, modules in listed.items():
        for module in sorted(modules):
            assert importlib.util.find_spec(module) is not None, f"{section} lists {module}, which does not exist"
    required, allowed = modules_on_disk("airflow_stream_provider")
    for section in _SECTIONS:
        missing, extra = required[section] - listed[section], listed[section] - allowed[section]
        assert not missing, f"get_provider_info()[{section!r}] does not list {sorted(missing)}"
        assert not extra, f"get_provider_info()[{section!r}] lists {sorted(extra)}, which define no {section}"


def test_every_operator_and_sensor_has_the_stream_links():
    from airflow_stream_provider.links import STREAM_LINKS

    _, allowed = modules_on_disk("airflow_stream_provider")
    classes = [cls for module in allowed["operators"] | allowed["sensors"]
               for _, cls in inspect.getmembers(importlib.import_module(module), inspect.isclass)
               if cls.__module__ == module and _kind(cls) in ("operators", "sensors")]
    assert len(classes) >= 8, classes
    for cls in classes:
        assert tuple(cls.operator_extra_links) == STREAM_LINKS, f"{cls.__name__} lacks the stream links"
    assert {e.split(".")[-1] for e in get_provider_info()["extra-links"]} == {
        type(link).__name__ for link in STREAM_LINKS}


def test_an_unlisted_operator_module_is_found(tmp_path, monkeypatch):
    """The check above asks for a new operator module, and not for the base module it builds on."""
    package = tmp_path / "sample_provider"
    for folder in _SECTIONS:
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "operators" / "base.py").write_text(
        "from airflow.sdk import BaseOperator\n\nclass SampleBase(BaseOperator):\n"
        "    def execute(self, context):\n        return self.start(context)\n")
    (package / "operators" / "fresh.py").write_text(
        "from sample_provider.operators.base import SampleBase\n\n"
        "class FreshOperator(SampleBase):\n    def start(self, context):\n        return 1\n")
    (package / "triggers" / "helpers.py").write_text("class NotATrigger:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        required, allowed = modules_on_disk("sample_provider")
    finally:
        for name in [n for n in sys.modules if n == "sample_provider" or n.startswith("sample_provider.")]:
            del sys.modules[name]
    assert required == {"hooks": set(), "operators": {"sample_provider.operators.fresh"}, "sensors": set(),
                        "triggers": set()}
    assert allowed["operators"] == {"sample_provider.operators.base", "sample_provider.operators.fresh"}
    assert allowed["triggers"] == set()


# -- connection forms ----------------------------------------------------------------------------------
_CONN_TYPES = ("stream_state", "stream_kafka", "stream_checkpoint")


def test_connection_types_match_provider_yaml_schema():
    """The forms are valid by Airflow's own schema for provider.yaml, and each hook's name, and the form
    its ``get_ui_field_behaviour()`` returns, are the ones provider info declares."""
    import jsonschema

    schema_file = Path(importlib.util.find_spec("airflow").origin).parent / "provider.yaml.schema.json"
    schema = json.loads(schema_file.read_text())["properties"]["connection-types"]
    info = get_provider_info()
    jsonschema.validate(info["connection-types"], schema)
    assert sorted(c["connection-type"] for c in info["connection-types"]) == sorted(_CONN_TYPES)
    for conn in info["connection-types"]:
        module, _, name = conn["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook.hook_name == conn["hook-name"]
        form, declared = hook.get_ui_field_behaviour(), conn["ui-field-behaviour"]
        assert form["hidden_fields"] is declared["hidden-fields"]
        assert form["relabeling"] is declared["relabeling"]
        assert form["placeholders"] is declared["placeholders"]


def test_checkpoint_form_shows_the_default_webhdfs_port():
    from airflow_stream_provider.hooks.checkpoint import DEFAULT_WEBHDFS_PORT

    assert ui_field_behaviour("stream_checkpoint")["placeholders"]["port"] == str(DEFAULT_WEBHDFS_PORT)


def _plain_airflow_env(home: Path) -> dict[str, str]:
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}


def test_behaviours_cli_lists_the_connection_types_without_fab(tmp_path):
    """``airflow providers behaviours`` on this install, which has no FAB provider: the forms come from
    provider info.  No ``airflow db migrate`` needed: the command reads providers only."""
    assert importlib.util.find_spec("flask_appbuilder") is None, "FAB is installed: this test proves nothing"
    airflow = Path(sys.executable).parent / "airflow"
    result = subprocess.run([str(airflow), "providers", "behaviours", "--output", "json"], capture_output=True,
                            text=True, timeout=300, env=_plain_airflow_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    listed = {row["field_behaviours"] for row in json.loads(result.stdout)}
    assert set(_CONN_TYPES) <= listed, f"missing from `airflow providers behaviours`: {sorted(listed)}"


def test_airflow_plugins_lists_the_status_page(tmp_path):
    """``airflow plugins`` loads the plugin from provider info: its app and its menu entry."""
    airflow = Path(sys.executable).parent / "airflow"
    result = subprocess.run([str(airflow), "plugins", "--output", "json"], capture_output=True, text=True,
                            timeout=300, env=_plain_airflow_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    found = {row["name"]: row for row in json.loads(result.stdout)}
    assert "stream_status" in found, f"`airflow plugins` lists {sorted(found)}"
    plugin = found["stream_status"]
    assert "airflow-stream-provider" in str(plugin.get("source")), plugin
    assert "/stream-status" in str(plugin["fastapi_apps"]) and "Streams" in str(plugin["external_views"]), plugin


_PROBE = """
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("airflow.providers_manager").addHandler(Keep())
logging.getLogger("airflow.providers_manager").setLevel(logging.DEBUG)
from airflow.providers_manager import ProvidersManager
manager = ProvidersManager()
hooks = {t: manager.hooks[t].connection_testable for t in sys.argv[1:]}
print(json.dumps({
    "behaviours": {t: manager.field_behaviours.get(t) for t in sys.argv[1:]},
    "widgets": sorted(k for k in manager.connection_form_widgets if k.startswith("extra__stream_")),
    "testable": hooks,
    "complaints": [m for m in records if "airflow_stream_provider" in m],
}))
"""


def test_forms_load_without_fab_and_without_complaints(tmp_path):
    """Airflow loads the forms and the extra fields from provider info, says nothing about the
    provider's hooks ("UI widgets will be missing", a deprecated form method), and sees which
    connection types can be tested."""
    result = subprocess.run([sys.executable, "-c", _PROBE, *_CONN_TYPES], capture_output=True, text=True,
                            timeout=300, env=_plain_airflow_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["complaints"] == []
    for conn_type in _CONN_TYPES:
        form = ui_field_behaviour(conn_type)
        assert seen["behaviours"][conn_type]["hidden_fields"] == form["hidden_fields"]
        assert seen["behaviours"][conn_type]["relabeling"] == form["relabeling"]
    assert seen["widgets"] == ["extra__stream_checkpoint__timeout", "extra__stream_checkpoint__use_ssl",
                               "extra__stream_kafka__bootstrap_servers", "extra__stream_state__url"]
    assert seen["testable"] == {"stream_state": True, "stream_kafka": True, "stream_checkpoint": False}


# -- packaging -----------------------------------------------------------------------------------------
def test_package_metadata_declares_a_typed_airflow_provider():
    import tomllib

    from airflow_stream_provider import __version__

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["project"]["version"] == __version__
    classifiers = project["project"]["classifiers"]
    for classifier in ("Framework :: Apache Airflow", "Framework :: Apache Airflow :: Provider", "Typing :: Typed"):
        assert classifier in classifiers
    assert {"Homepage", "Documentation", "Changelog", "Source", "Bug Tracker"} <= set(project["project"]["urls"])
    assert (root / "airflow_stream_provider" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["airflow_stream_provider"]
    changelog = (root / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and f"## [{__version__}]" in changelog
