"""docker-compose.yml checked by construction.

CI has no Docker engine, so nothing here starts a container: the file is parsed with PyYAML and held
against the repository (build contexts, Dockerfiles, the files they copy, the scripts it mounts) and
against the README's "Production-shaped stack" section, whose two tables (services with their host
ports, named volumes) are the contract: both directions must agree.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
README = REPO / "README.md"
SECTION = "## Production-shaped stack (docker-compose)"

AIRFLOW_SERVICES = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
REQUIRED_SERVICES = (
    *AIRFLOW_SERVICES,
    "airflow-init",
    "kafka",
    "kafka-init",
    "spark-master",
    "spark-worker",
    "postgres",
    "namenode",
    "datanode",
)
_DEFAULTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?-([^}]*)\}")
_CODE = re.compile(r"`([^`]+)`")
#: `docker compose` verbs whose first positional argument is a service.
_SERVICE_VERBS = {"exec", "run", "logs", "restart", "stop", "start", "kill", "rm", "top", "port", "attach"}
#: Options of those verbs that take a value.
_VALUE_OPTIONS = {"-e", "--env", "-u", "--user", "-w", "--workdir", "--index", "--name", "--entrypoint", "-p",
                  "--publish", "-v", "--volume", "-t", "--timeout", "-s", "--signal", "--tail", "--since",
                  "--until"}


# -- helpers -----------------------------------------------------------------------------------------
def with_defaults(text: str) -> str:
    """What Compose makes of ``text`` when no variable is set: ``${VAR:-default}`` becomes ``default``."""
    return _DEFAULTED.sub(lambda m: m.group(2), str(text)).replace("$$", "$")


def host_ports(service: dict) -> list[int]:
    ports = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            if entry.get("published") is not None:
                ports.append(int(with_defaults(entry["published"])))
            continue
        parts = with_defaults(entry).split("/")[0].split(":")
        if len(parts) >= 2:  # [ip:]host:container; a bare container port publishes on a random port
            ports.append(int(parts[-2]))
    return ports


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def volume_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of every mount; a named volume's source has no path syntax."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            mounts.append((str(entry.get("source", "")), str(entry["target"])))
        else:
            source, _, rest = with_defaults(entry).partition(":")
            mounts.append((source, rest.split(":")[0]) if rest else ("", source))
    return mounts


def is_named(source: str) -> bool:
    return bool(source) and not source.startswith((".", "/", "~", "$"))


def readme_section() -> str:
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    following = re.search(r"^## ", body, flags=re.MULTILINE)
    return body[: following.start()] if following else body


def tables(markdown: str) -> dict[str, list[list[str]]]:
    """Markdown tables by the lower-cased text of their first header cell: rows of raw cells."""
    found: dict[str, list[list[str]]] = {}
    block: list[str] = []
    for line in [*markdown.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            block.append(line.strip())
            continue
        if len(block) >= 2:
            rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in block]
            header, body = rows[0], [r for r in rows[2:] if any(r)]
            found[header[0].lower()] = body
        block = []
    return found


def dockerfile_instructions(path: Path) -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        joined.append(current + stripped)
        current = ""
    return joined


def dockerignored(context: Path, source: str) -> str | None:
    """The `.dockerignore` pattern that keeps ``source`` (or a folder above it) out of the context."""
    ignore = context / ".dockerignore"
    if not ignore.is_file():
        return None
    patterns = [line.strip().strip("/") for line in ignore.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "!"))]
    parts = Path(source.strip("/")).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return next((p for p in patterns for c in candidates if fnmatch.fnmatchcase(c, p)), None)


def dockerfile_arg_default(path: Path, name: str) -> str | None:
    for instruction in dockerfile_instructions(path):
        match = re.match(rf"ARG\s+{name}=(\S+)$", instruction)
        if match:
            return match.group(1)
    return None


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    with COMPOSE.open(encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "no services in the file"
    return data


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


@pytest.fixture(scope="module")
def section() -> str:
    return readme_section()


@pytest.fixture(scope="module")
def builds(services) -> dict[str, dict]:
    found = {}
    for name, service in services.items():
        build = service.get("build")
        if build is not None:
            found[name] = {"context": build} if isinstance(build, str) else build
    return found


# -- the stack ---------------------------------------------------------------------------------------
def test_the_stack_has_every_component(services):
    missing = [name for name in REQUIRED_SERVICES if name not in services]
    assert not missing, f"docker-compose.yml lacks services {missing}"


def test_depends_on_targets_exist_and_their_conditions_can_hold(services):
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        targets = {t: {} for t in depends} if isinstance(depends, list) else depends
        for target, spec in targets.items():
            assert target in services, f"{name} depends on {target!r}, which is not a service"
            condition = (spec or {}).get("condition", "service_started")
            assert condition in ("service_started", "service_healthy", "service_completed_successfully"), (
                f"{name} -> {target}: unknown condition {condition!r}")
            if condition == "service_healthy":
                check = services[target].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), (
                    f"{name} waits for {target} to be healthy, but {target} has no healthcheck")
            if condition == "service_completed_successfully":
                assert services[target].get("restart", "no") in ("no", False), (
                    f"{name} waits for {target} to complete, but {target} is restarted and never completes")


def test_named_volumes_are_declared_and_used(compose, services):
    declared = set(compose.get("volumes") or {})
    used = {source for service in services.values() for source, _ in volume_mounts(service) if is_named(source)}
    assert used - declared == set(), f"named volumes used but not declared: {sorted(used - declared)}"
    assert declared - used == set(), f"named volumes declared but never mounted: {sorted(declared - used)}"


def test_host_ports_are_unique(services):
    owners: dict[int, list[str]] = {}
    for name, service in services.items():
        for port in host_ports(service):
            owners.setdefault(port, []).append(name)
    clashes = {port: names for port, names in owners.items() if len(names) > 1}
    assert not clashes, f"host ports published twice: {clashes}"


def test_builds_point_at_real_contexts_dockerfiles_and_files(builds):
    assert builds, "no service is built from this repository"
    for name, build in builds.items():
        context = (REPO / build.get("context", ".")).resolve()
        assert context.is_dir(), f"{name}: build context {build.get('context')!r} does not exist"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: Dockerfile {build.get('dockerfile')!r} does not exist"
        for instruction in dockerfile_instructions(dockerfile):
            words = instruction.split()
            if words[0].upper() not in ("COPY", "ADD") or any(w.startswith("--from") for w in words):
                continue
            sources = [w for w in words[1:] if not w.startswith("--")][:-1]
            for source in sources:
                assert list(context.glob(source)), (
                    f"{name}: {dockerfile.relative_to(REPO)} copies {source!r}, which does not exist")
                pattern = dockerignored(context, source)
                assert pattern is None, (
                    f"{name}: {dockerfile.relative_to(REPO)} copies {source!r}, but .dockerignore drops it "
                    f"({pattern!r})")


def test_every_image_runs_one_spark_release(builds):
    """Standalone masters and their drivers must run the same Spark, and it must be the one the
    package's `spark` extra allows."""
    versions = {}
    for name, build in builds.items():
        dockerfile = REPO / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: Dockerfile {build.get('dockerfile')!r} does not exist"
        default = dockerfile_arg_default(dockerfile, "SPARK_VERSION")
        assert default, f"{name}: {dockerfile.relative_to(REPO)} declares no ARG SPARK_VERSION"
        versions[name] = with_defaults((build.get("args") or {}).get("SPARK_VERSION", default))
        assert versions[name] == default, (
            f"{name}: compose passes SPARK_VERSION={versions[name]}, the Dockerfile defaults to {default}")
    assert len(set(versions.values())) == 1, f"images built for different Spark releases: {versions}"
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["spark"]
    pin = next(req for req in extra if req.replace(" ", "").startswith("pyspark=="))
    prefix = pin.replace(" ", "").removeprefix("pyspark==").rstrip("*")
    assert next(iter(versions.values())).startswith(prefix), f"Spark {versions} does not satisfy {pin!r}"


def test_bind_mounted_files_ship_with_the_repository(services):
    for name, service in services.items():
        for source, target in volume_mounts(service):
            if source.startswith("./docker/"):
                assert (REPO / source).exists(), f"{name} mounts {source} at {target}, which does not exist"


def test_airflow_services_see_the_dags_and_the_jobs(services):
    for name in AIRFLOW_SERVICES:
        mounts = dict((target, source) for source, target in volume_mounts(services[name]))
        assert mounts.get("/opt/airflow/dags", "").rstrip("/") == "./dags", f"{name} does not mount ./dags"
        assert mounts.get("/opt/airflow/spark_jobs", "").rstrip("/") == "./spark_jobs", (
            f"{name} does not mount ./spark_jobs where drivers read the job files")


def test_secrets_come_from_overridable_variables(services):
    """Every password, secret and key has a `${VAR:-default}` default, so production can override it."""
    overridable = re.compile(r"^\$\{[A-Z][A-Z0-9_]*:-[^}]*\}$")
    for name, service in services.items():
        for key, value in environment(service).items():
            if re.search(r"PASSWORD|SECRET|FERNET_KEY", key):
                assert overridable.match(value), f"{name}: {key} is not read from a variable: {value!r}"
            credential = re.search(r"://[^:/@\s]+:([^@\s]+)@", value)
            if credential:
                assert overridable.match(credential.group(1)), (
                    f"{name}: {key} embeds a password that no variable can override")


def test_images_are_pinned(services):
    for name, service in services.items():
        if "build" in service:
            continue
        image = with_defaults(service.get("image", ""))
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image!r} is not pinned to a release"


def test_kafka_topics_are_created_not_auto_created(services):
    assert environment(services["kafka"]).get("KAFKA_AUTO_CREATE_TOPICS_ENABLE") == "false"
    command = with_defaults(" ".join(services["kafka-init"].get("command") or []))
    assert "--create" in command and "--topic events" in command, "kafka-init does not create `events`"
    partitions = re.search(r"--partitions\s+(\d+)", command)
    assert partitions and int(partitions.group(1)) > 1, "the events topic needs several partitions"


# -- the README section ------------------------------------------------------------------------------
def test_readme_lists_exactly_the_services_and_their_host_ports(services, section):
    rows = tables(section).get("service")
    assert rows, "the README section has no table whose first column is 'service'"
    listed = {}
    for row in rows:
        names = _CODE.findall(row[0])
        assert len(names) == 1, f"README service row needs one `name` in its first cell: {row}"
        listed[names[0]] = {int(p) for p in _CODE.findall(row[1]) if p.isdigit()}
    assert set(listed) - set(services) == set(), (
        f"README names services docker-compose.yml lacks: {sorted(set(listed) - set(services))}")
    assert set(services) - set(listed) == set(), (
        f"services missing from the README table: {sorted(set(services) - set(listed))}")
    for name, ports in listed.items():
        assert ports == set(host_ports(services[name])), (
            f"README says {name} publishes {sorted(ports)}, the file {sorted(host_ports(services[name]))}")


def test_readme_lists_exactly_the_named_volumes(compose, section):
    rows = tables(section).get("volume")
    assert rows, "the README section has no table whose first column is 'volume'"
    listed = {name for row in rows for name in _CODE.findall(row[0])}
    declared = set(compose.get("volumes") or {})
    assert listed == declared, f"README volumes {sorted(listed)} != declared volumes {sorted(declared)}"


def test_readme_ports_are_published_ports(services, section):
    published = {port for service in services.values() for port in host_ports(service)}
    prose = re.sub(r"```.*?```", "", section, flags=re.DOTALL)
    mentioned = {int(token) for token in _CODE.findall(prose) if token.isdigit()}
    assert mentioned <= published, f"README mentions ports nothing publishes: {sorted(mentioned - published)}"


def test_readme_commands_name_real_services(services, section):
    text = section.replace("\\\n", " ")
    commands = re.findall(r"docker compose[ \t]+([a-z]+)((?:[ \t]+[^\s|;&]+)*)", text)
    named = []
    for verb, rest in commands:
        if verb not in _SERVICE_VERBS:
            continue
        words = shlex.split(rest, posix=True) if rest.count("'") % 2 == 0 else rest.split()
        skip_value = False
        for word in words:
            if skip_value:
                skip_value = False
            elif word in _VALUE_OPTIONS:
                skip_value = True
            elif not word.startswith("-"):
                named.append(word)
                break
    assert named, "the README section shows no `docker compose exec ...` command"
    unknown = sorted(set(named) - set(services))
    assert not unknown, f"README commands name services docker-compose.yml lacks: {unknown}"
