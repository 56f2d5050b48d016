"""CheckpointHook on real storage: a local directory (always), HDFS through WebHDFS (when WEBHDFS_URL is set).

Checkpoints are built file by file in Spark's on-disk format (``metadata``, ``offsets/N`` as
"v1 / batch metadata / source offsets", ``commits/N``, ``sources/0/0``, and on the local filesystem the
``.N.crc`` companions Hadoop's ChecksumFileSystem writes), so the hook reads what a driver leaves behind.
"""

from __future__ import annotations

import calendar
import getpass
import json
import os
import struct
import time
import uuid
import zlib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.hooks.checkpoint import BatchInfo, CheckpointHook, GenerationInfo
from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec

JOB = "events-job"
TOPIC = "events"
# 2024-05-01T12:00:00Z, so archive names and ages are exact.
NOW = float(calendar.timegm((2024, 5, 1, 12, 0, 0, 0, 0, 0)))
DAY = 86_400.0
STATE_STORE_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"


# -- Spark's on-disk format ----------------------------------------------------------------------------
class LocalTree:
    """Writes files under a local directory, with the ``.N.crc`` files Hadoop's local filesystem adds."""

    crc = True

    def __init__(self, root: Path):
        self.root = root

    def write(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def mkdir(self, rel: str) -> None:
        (self.root / rel).mkdir(parents=True, exist_ok=True)

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.root / rel)

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def listdir(self, rel: str) -> list[str]:
        return sorted(os.listdir(self.root / rel))


def hadoop_crc(data: bytes, bytes_per_checksum: int = 512) -> bytes:
    """The content of Hadoop ChecksumFileSystem's ``.name.crc``: header, then a CRC32 per chunk."""
    chunks = [data[i : i + bytes_per_checksum] for i in range(0, len(data), bytes_per_checksum)] or [b""]
    return (
        b"crc\x00"
        + struct.pack(">i", bytes_per_checksum)
        + b"".join(struct.pack(">I", zlib.crc32(chunk)) for chunk in chunks)
    )


def write_log_file(tree, directory: str, name: str, text: str) -> None:
    data = text.encode()
    tree.write(f"{directory}/{name}", data)
    if tree.crc:
        tree.write(f"{directory}/.{name}.crc", hadoop_crc(data))


def new_checkpoint(tree, gen: str, start: dict[str, dict[str, int]] | None = None) -> None:
    """What a query leaves right after it started: ``metadata``, the source's initial offsets, empty logs."""
    write_log_file(tree, gen, "metadata", json.dumps({"id": str(uuid.uuid4())}))
    write_log_file(tree, f"{gen}/sources/0", "0", "v1\n" + json.dumps(start or {TOPIC: {"0": 0, "1": 0}}))
    tree.mkdir(f"{gen}/offsets")
    tree.mkdir(f"{gen}/commits")


def add_batch(tree, gen: str, batch_id: int, offsets: dict[str, dict[str, int]], *, committed: bool) -> None:
    """offsets/N is written before batch N runs; commits/N after its sink finished."""
    metadata = {
        "batchWatermarkMs": 0,
        "batchTimestampMs": 1714564800000 + batch_id * 1000,
        "conf": {
            "spark.sql.shuffle.partitions": "200",
            "spark.sql.streaming.stateStore.providerClass": STATE_STORE_PROVIDER,
        },
    }
    write_log_file(
        tree,
        f"{gen}/offsets",
        str(batch_id),
        "v1\n"
        + json.dumps(metadata, separators=(",", ":"))
        + "\n"
        + json.dumps(offsets, separators=(",", ":")),
    )
    if committed:
        write_log_file(tree, f"{gen}/commits", str(batch_id), 'v1\n{"nextBatchWatermarkMs":0}')


def build_job(tree) -> None:
    """gen-1: batches 0-2 all committed.  gen-2: batch 0 committed, batch 1 planned but not committed."""
    new_checkpoint(tree, f"{JOB}/gen-1")
    for batch_id in range(3):
        add_batch(
            tree,
            f"{JOB}/gen-1",
            batch_id,
            {TOPIC: {"0": 10 * (batch_id + 1), "1": 5 * (batch_id + 1)}},
            committed=True,
        )
    tree.write(f"{JOB}/gen-1/state/0/0/1.delta", b"\x00\x00\x00\x01state-bytes")
    new_checkpoint(tree, f"{JOB}/gen-2", {TOPIC: {"0": 30, "1": 15}})
    add_batch(tree, f"{JOB}/gen-2", 0, {TOPIC: {"0": 42, "1": 20}}, committed=True)
    add_batch(tree, f"{JOB}/gen-2", 1, {TOPIC: {"0": 50, "1": 27}}, committed=False)


# -- local fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory next to the root, holding a checkpoint the hook must never touch."""
    path = tmp_path / "outside"
    tree = LocalTree(path)
    new_checkpoint(tree, "gen-1")
    add_batch(tree, "gen-1", 0, {TOPIC: {"0": 1}}, committed=True)
    return path


@pytest.fixture
def tree(root) -> LocalTree:
    tree = LocalTree(root)
    build_job(tree)
    return tree


@pytest.fixture
def hook(root) -> CheckpointHook:
    return CheckpointHook(str(root))


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- the shared scenario: runs on the local filesystem and on HDFS ------------------------------------
def run_scenario(hook: CheckpointHook, tree, root_text: str) -> None:
    build_job(tree)
    job_root = f"{root_text}/{JOB}"
    assert hook.job_root(JOB) == job_root
    assert hook.generation_path(JOB, 2) == f"{job_root}/gen-2"

    generations = hook.list_generations(JOB)
    assert [(g.generation, g.archived) for g in generations] == [(1, False), (2, False)]
    gen1, gen2 = generations
    assert gen1.path == f"{job_root}/gen-1"
    assert gen1.latest_batch == BatchInfo(2, {(TOPIC, 0): 30, (TOPIC, 1): 15}, True)
    assert gen1.latest_committed == 2
    assert gen2.latest_batch == BatchInfo(1, {(TOPIC, 0): 50, (TOPIC, 1): 27}, False)
    assert gen2.latest_committed == 0
    assert gen2.modified_at is not None and gen2.modified_at > 0
    assert hook.has_checkpoint(gen2.path)
    json.dumps([g.to_dict() for g in generations])

    archived = hook.archive_generation(JOB, 1, now=NOW)
    assert archived == f"{job_root}/archive/gen-1-20240501T120000Z"
    assert not tree.exists(f"{JOB}/gen-1")
    assert tree.listdir(f"{JOB}/archive/gen-1-20240501T120000Z/offsets")[-3:] == ["0", "1", "2"]
    assert (
        tree.read(f"{JOB}/archive/gen-1-20240501T120000Z/state/0/0/1.delta") == b"\x00\x00\x00\x01state-bytes"
    )
    generations = hook.list_generations(JOB)
    assert [(g.generation, g.archived, g.path) for g in generations] == [
        (1, True, archived),
        (2, False, f"{job_root}/gen-2"),
    ]
    assert generations[0].latest_batch == gen1.latest_batch

    copy = hook.copy_generation(JOB, 2, f"{job_root}/preflight/upgrade-1")
    assert copy == f"{job_root}/preflight/upgrade-1"
    assert tree.read(f"{JOB}/preflight/upgrade-1/offsets/1") == tree.read(f"{JOB}/gen-2/offsets/1")
    assert tree.exists(f"{JOB}/preflight/upgrade-1/commits/0")
    assert hook.drop_latest_commit(copy) == 0
    assert not tree.exists(f"{JOB}/preflight/upgrade-1/commits/0")
    assert tree.exists(f"{JOB}/gen-2/commits/0"), "the active generation must be untouched"
    with pytest.raises(ValueError, match="active gen"):
        hook.drop_latest_commit(f"{job_root}/gen-2")
    with pytest.raises(ValueError, match="archive"):
        hook.drop_latest_commit(archived)

    assert hook.prune_archives(JOB) == []
    assert hook.prune_archives(JOB, max_count=0, now=NOW) == [archived]
    assert not tree.exists(f"{JOB}/archive/gen-1-20240501T120000Z")
    assert [(g.generation, g.archived) for g in hook.list_generations(JOB)] == [(2, False)]
    assert tree.exists(f"{JOB}/gen-2/commits/0")


def test_scenario_on_local_filesystem(root):
    run_scenario(CheckpointHook(str(root)), LocalTree(root), str(root))


def test_scenario_with_file_uri_root(root):
    """A file:// root gives back file:// paths, exactly as the spec spells the checkpoint path."""
    run_scenario(CheckpointHook(f"file://{root}/"), LocalTree(root), f"file://{root}")


# -- reading -------------------------------------------------------------------------------------------
def test_paths_match_the_job_spec(root):
    spec = StreamJobSpec(
        job_id=JOB,
        version="1",
        kafka=KafkaSpec("localhost:9092", (TOPIC,)),
        checkpoint_root=str(root),
        database_url="sqlite:////tmp/x.db",
        generation=3,
    )
    hook = CheckpointHook(spec.checkpoint_root)
    assert hook.job_root(JOB) == spec.job_root
    assert hook.generation_path(JOB, 3) == spec.checkpoint_path


def test_list_generations_of_an_unknown_job_is_empty(hook):
    assert hook.list_generations("never-ran") == []


def test_latest_batch_with_and_without_commit(hook, tree):
    committed = hook.latest_batch(hook.generation_path(JOB, 1))
    assert committed == BatchInfo(batch_id=2, offsets={(TOPIC, 0): 30, (TOPIC, 1): 15}, committed=True)
    planned = hook.latest_batch(hook.generation_path(JOB, 2))
    assert planned == BatchInfo(batch_id=1, offsets={(TOPIC, 0): 50, (TOPIC, 1): 27}, committed=False)


def test_fresh_checkpoint_has_no_batch(hook, root):
    new_checkpoint(LocalTree(root), f"{JOB}/gen-3")
    path = hook.generation_path(JOB, 3)
    assert hook.latest_batch(path) is None
    assert not hook.has_checkpoint(path)
    info = [g for g in hook.list_generations(JOB) if g.generation == 3][0]
    assert info.latest_batch is None and info.latest_committed is None
    assert not hook.has_checkpoint(hook.generation_path(JOB, 9))


def test_offsets_of_several_topics_are_parsed(hook, root):
    tree = LocalTree(root)
    new_checkpoint(tree, f"{JOB}/gen-1")
    add_batch(tree, f"{JOB}/gen-1", 0, {"a": {"0": 3, "2": 9}, "b.x_y-z": {"0": 0}}, committed=False)
    batch = hook.latest_batch(hook.generation_path(JOB, 1))
    assert batch.offsets == {("a", 0): 3, ("a", 2): 9, ("b.x_y-z", 0): 0}
    assert batch.to_dict() == {
        "batch_id": 0,
        "offsets": {"a": {"0": 3, "2": 9}, "b.x_y-z": {"0": 0}},
        "committed": False,
    }


def test_unparseable_offsets_are_reported_as_none(hook, tree):
    for text in ("garbage", "v1\n{}", 'v1\n{}\n{"events": {"x": 1}}', "v1\n{}\n{not json"):
        write_log_file(tree, f"{JOB}/gen-2/offsets", "7", text)
        batch = hook.latest_batch(hook.generation_path(JOB, 2))
        assert batch == BatchInfo(batch_id=7, offsets=None, committed=False), text


def test_crc_tmp_and_other_names_are_not_batches(hook, tree):
    gen = f"{JOB}/gen-2"
    tree.write(f"{gen}/offsets/.5.3f2a9c1e-77aa-4a43-9c1d-6b0b2b7b1e11.tmp", b"v1\n{}\n{")
    tree.write(f"{gen}/offsets/.5.3f2a9c1e-77aa-4a43-9c1d-6b0b2b7b1e11.tmp.crc", b"crc\x00")
    tree.write(f"{gen}/commits/.9.crc", hadoop_crc(b"x"))
    tree.write(f"{gen}/commits/9.tmp", b"v1\n{}")
    tree.mkdir(f"{gen}/offsets/12")
    info = [g for g in hook.list_generations(JOB) if g.generation == 2][0]
    assert info.latest_batch.batch_id == 1
    assert info.latest_committed == 0


def test_modified_at_is_the_newest_file_time(hook, tree, root):
    gen = root / JOB / "gen-2"
    for path in [gen, *gen.rglob("*")]:
        os.utime(path, (NOW - DAY, NOW - DAY))
    os.utime(gen / "commits" / "0", (NOW - 60, NOW - 60))
    info = [g for g in hook.list_generations(JOB) if g.generation == 2][0]
    assert info.modified_at == pytest.approx(NOW - 60)


def test_generation_info_to_dict_is_json(hook, tree):
    info = hook.list_generations(JOB)[1]
    assert isinstance(info, GenerationInfo)
    data = json.loads(json.dumps(info.to_dict()))
    assert data["generation"] == 2 and data["archived"] is False
    assert data["latest_batch"] == {"batch_id": 1, "offsets": {TOPIC: {"0": 50, "1": 27}}, "committed": False}
    assert kafka_offsets.from_spark_json(data["latest_batch"]["offsets"]) == info.latest_batch.offsets


# -- archive -------------------------------------------------------------------------------------------
def test_archive_renames_and_keeps_everything(hook, tree, root):
    before = snapshot(root / JOB / "gen-1")
    files_before = len(list(root.rglob("*")))
    path = hook.archive_generation(JOB, 1, now=NOW)
    assert path == f"{root}/{JOB}/archive/gen-1-20240501T120000Z"
    assert not (root / JOB / "gen-1").exists()
    assert snapshot(Path(path)) == before
    assert len(list(root.rglob("*"))) == files_before + 1  # only the archive/ folder is new
    assert (root / JOB / "gen-2" / "offsets" / "1").exists()


def test_archive_uses_the_current_utc_time_by_default(hook, tree):
    path = hook.archive_generation(JOB, 2)
    stamp = path.rsplit("gen-2-", 1)[1]
    assert abs(calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ")) - time.time()) < 120


def test_archive_of_a_missing_generation_fails_clearly(hook, tree, root):
    before = snapshot(root)
    with pytest.raises(FileNotFoundError, match=r"generation 7 of job 'events-job'.*does not exist.*gen-1"):
        hook.archive_generation(JOB, 7, now=NOW)
    assert snapshot(root) == before


def test_archive_refuses_an_existing_target(hook, tree, root):
    (root / JOB / "archive" / "gen-2-20240501T120000Z").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already exists"):
        hook.archive_generation(JOB, 2, now=NOW)
    assert (root / JOB / "gen-2" / "offsets" / "1").exists()
    assert os.listdir(root / JOB / "archive" / "gen-2-20240501T120000Z") == []


# -- copy and drop_latest_commit -------------------------------------------------------------------------
def test_copy_of_a_live_generation_skips_files_removed_meanwhile(hook, tree, root, monkeypatch):
    """Spark purges old batches and renames temp files while a preflight copies: those are skipped, and
    commits are copied before offsets so no commit in the copy lacks its offsets."""
    import shutil

    from airflow_stream_provider.hooks import checkpoint

    copied, real_copy = [], shutil.copy2

    def racing_copy(source, target):
        if source.endswith(os.path.join("offsets", "0")):
            os.remove(source)  # the live query's retention got there first
        copied.append(os.path.relpath(source, root / JOB / "gen-1"))
        return real_copy(source, target)

    monkeypatch.setattr(checkpoint.shutil, "copy2", racing_copy)
    copy = Path(hook.copy_generation(JOB, 1, f"{root}/{JOB}/preflight/live"))
    assert not (copy / "offsets" / "0").exists() and (copy / "offsets" / "2").exists()
    assert (copy / "commits" / "1").exists()
    first_offset = min(i for i, name in enumerate(copied) if name.startswith("offsets"))
    assert all(name.startswith("commits") for name in copied[:first_offset]) and first_offset > 0


def test_preflight_copy_is_made_and_removed_inside_its_own_directory(hook, tree, root):
    preflight = hook.new_preflight_root(JOB)
    assert preflight.startswith(f"{root}/{JOB}/preflight/") and preflight != hook.new_preflight_root(JOB)
    copy = hook.copy_generation(JOB, 1, f"{preflight}/{JOB}/gen-1")
    assert snapshot(Path(copy)) == snapshot(root / JOB / "gen-1")
    for elsewhere in (str(root / JOB / "gen-1"), f"{root}/{JOB}/preflight", f"{preflight}/{JOB}", str(root)):
        with pytest.raises(ValueError, match="refusing to remove|outside the checkpoint root"):
            hook.remove_preflight(JOB, elsewhere)
    hook.remove_preflight(JOB, preflight)
    assert not Path(preflight).exists() and (root / JOB / "gen-1" / "commits" / "2").exists()


@pytest.mark.parametrize("linked_to", ["job", "archive"])
def test_a_preflight_dir_that_is_a_link_removes_nothing_through_it(hook, tree, root, linked_to):
    """A preflight dir that links to the job's dir (or its archive), inside the root, passed the check that a
    copy is a child of it: removing ``preflight/gen-1`` removed the live generation, or an archive."""
    target = root / JOB if linked_to == "job" else root / JOB / "archive"
    (root / JOB / "archive" / "gen-1-20240501T120000Z").mkdir(parents=True)
    (root / JOB / "preflight").symlink_to(target, target_is_directory=True)
    name = "gen-1" if linked_to == "job" else "gen-1-20240501T120000Z"
    with pytest.raises(ValueError, match="is a link to"):
        hook.remove_preflight(JOB, f"{root}/{JOB}/preflight/{name}")
    assert (target / name).is_dir()


def test_copy_then_drop_latest_commit_on_the_copy(hook, tree, root):
    target = hook.copy_generation(JOB, 1, f"{root}/{JOB}/preflight/v2")
    assert snapshot(Path(target)) == snapshot(root / JOB / "gen-1")
    assert [p.name for p in (root / JOB / "preflight").iterdir()] == ["v2"], "no partial copy left behind"
    assert hook.drop_latest_commit(target) == 2
    assert sorted(os.listdir(Path(target) / "commits")) == [".0.crc", ".1.crc", "0", "1"]
    assert hook.latest_batch(target) == BatchInfo(2, {(TOPIC, 0): 30, (TOPIC, 1): 15}, False)
    assert (root / JOB / "gen-1" / "commits" / "2").exists()
    assert (root / JOB / "gen-1" / "commits" / ".2.crc").exists()


def test_copy_target_outside_gen_dirs_may_be_anywhere_in_the_root(hook, tree, root):
    target = hook.copy_generation(JOB, 2, str(root / "scratch" / "copy"))
    assert hook.drop_latest_commit(target) == 0


def test_drop_latest_commit_refuses_active_and_archived_generations(hook, tree, root):
    for path in (
        hook.generation_path(JOB, 2),
        f"{hook.generation_path(JOB, 2)}/commits/..",
        str(root / JOB / "gen-2"),
    ):
        with pytest.raises(ValueError, match="active gen-"):
            hook.drop_latest_commit(path)
    archived = hook.archive_generation(JOB, 1, now=NOW)
    with pytest.raises(ValueError, match="archive"):
        hook.drop_latest_commit(archived)
    assert (root / JOB / "gen-2" / "commits" / "0").exists()
    assert (Path(archived) / "commits" / "2").exists()


def test_drop_latest_commit_without_commits_returns_none(hook, tree, root):
    new_checkpoint(LocalTree(root), f"{JOB}/preflight/empty")
    assert hook.drop_latest_commit(f"{root}/{JOB}/preflight/empty") is None


def test_copy_refuses_existing_targets_and_gen_or_archive_targets(hook, tree, root):
    (root / JOB / "preflight" / "taken").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already exists"):
        hook.copy_generation(JOB, 1, str(root / JOB / "preflight" / "taken"))
    for target in (root / JOB / "gen-9", root / JOB / "gen-2" / "copy", root / JOB / "archive" / "x"):
        with pytest.raises(ValueError, match="active gen-\\* or archive"):
            hook.copy_generation(JOB, 1, str(target))
    with pytest.raises(FileNotFoundError, match="generation 5"):
        hook.copy_generation(JOB, 5, str(root / JOB / "preflight" / "new"))
    assert not (root / JOB / "gen-9").exists()


# -- prune ---------------------------------------------------------------------------------------------
def make_archives(hook: CheckpointHook, tree, ages_days: list[float]) -> list[str]:
    """Archive one generation per age, oldest first; returns the archive paths in that order."""
    paths = []
    for index, age in enumerate(ages_days, start=10):
        new_checkpoint(tree, f"{JOB}/gen-{index}")
        add_batch(tree, f"{JOB}/gen-{index}", 0, {TOPIC: {"0": index}}, committed=True)
        paths.append(hook.archive_generation(JOB, index, now=NOW - age * DAY))
    return paths


def test_prune_by_count_keeps_the_newest(hook, tree):
    paths = make_archives(hook, tree, [40, 30, 20, 10])
    removed = hook.prune_archives(JOB, max_count=2, now=NOW)
    assert sorted(removed) == sorted(paths[:2])
    assert [g.path for g in hook.list_generations(JOB) if g.archived] == paths[2:]
    assert [g.generation for g in hook.list_generations(JOB) if not g.archived] == [1, 2]


def test_prune_by_age(hook, tree):
    paths = make_archives(hook, tree, [40, 30, 20, 10])
    removed = hook.prune_archives(JOB, max_age_s=25 * DAY, now=NOW)
    assert sorted(removed) == sorted(paths[:2])
    assert [g.path for g in hook.list_generations(JOB) if g.archived] == paths[2:]


def test_prune_keeps_what_any_rule_keeps(hook, tree):
    paths = make_archives(hook, tree, [40, 30, 20, 10])
    assert hook.prune_archives(JOB, max_count=1, max_age_s=25 * DAY, now=NOW) == paths[:2][::-1]
    assert hook.prune_archives(JOB, max_count=3, max_age_s=1 * DAY, now=NOW) == []


def test_prune_without_a_policy_removes_nothing(hook, tree, root):
    make_archives(hook, tree, [400, 300])
    before = snapshot(root)
    assert hook.prune_archives(JOB, now=NOW) == []
    assert snapshot(root) == before


def test_prune_never_touches_active_generations_or_foreign_entries(hook, tree, root):
    make_archives(hook, tree, [40])
    (root / JOB / "archive" / "notes").mkdir()
    (root / JOB / "archive" / "gen-3-manual").mkdir()
    active = snapshot(root / JOB / "gen-1"), snapshot(root / JOB / "gen-2")
    assert len(hook.prune_archives(JOB, max_count=0, max_age_s=0, now=NOW)) == 1
    assert (snapshot(root / JOB / "gen-1"), snapshot(root / JOB / "gen-2")) == active
    assert sorted(os.listdir(root / JOB / "archive")) == ["gen-3-manual", "notes"]


@pytest.mark.parametrize(
    "policy",
    [{"max_count": -1}, {"max_count": 1.5}, {"max_count": True}, {"max_age_s": -1.0}, {"max_age_s": "1d"},
     # no archive is "younger than" NaN: it would remove all of them
     {"max_age_s": float("nan")}, {"max_age_s": float("inf")}],
)
def test_prune_rejects_a_malformed_policy(hook, tree, policy):
    with pytest.raises(ValueError, match=next(iter(policy))):
        hook.prune_archives(JOB, **policy)


# -- security: every path stays inside the root -------------------------------------------------------
BAD_JOB_IDS = ["../x", "a/b", "..", "a..b", "", "/etc", ".hidden", "a\\b", "gen 1", "x" * 101]


@pytest.mark.parametrize("job_id", BAD_JOB_IDS)
def test_job_ids_with_path_characters_are_rejected(hook, tree, root, job_id):
    before = snapshot(root.parent)
    calls = [
        lambda: hook.job_root(job_id),
        lambda: hook.generation_path(job_id, 1),
        lambda: hook.list_generations(job_id),
        lambda: hook.archive_generation(job_id, 1),
        lambda: hook.copy_generation(job_id, 1, str(root / "copy")),
        lambda: hook.prune_archives(job_id, max_count=0),
    ]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        assert repr(job_id) in str(err.value)
        assert "letters, digits, '.', '_' or '-'" in str(err.value)
    assert snapshot(root.parent) == before


@pytest.mark.parametrize("generation", [0, -1, True, "1", 1.0])
def test_generations_must_be_positive_integers(hook, generation):
    with pytest.raises(ValueError, match="generation"):
        hook.generation_path(JOB, generation)


def test_path_escapes_are_rejected(hook, tree, root, outside):
    before = snapshot(root.parent)
    escapes = [
        f"{root}/{JOB}/../../outside/gen-1",
        f"{root}/../outside/gen-1",
        str(outside / "gen-1"),
        "/etc",
        f"file://{outside}/gen-1",
        f"file://otherhost{root}/{JOB}/preflight/x",
        f"hdfs://namenode:8020{root}/{JOB}/preflight/x",
        str(root),  # the root itself is not a place to write
    ]
    for path in escapes:
        with pytest.raises(ValueError) as err:
            hook.drop_latest_commit(path)
        assert repr(path) in str(err.value)
        with pytest.raises(ValueError):
            hook.copy_generation(JOB, 1, path)
    for path in escapes[:6]:
        with pytest.raises(ValueError, match="outside the checkpoint root|names host|scheme"):
            hook.latest_batch(path)
        with pytest.raises(ValueError):
            hook.has_checkpoint(path)
    assert snapshot(root.parent) == before


def test_symlinked_job_root_pointing_out_is_rejected(tmp_path, root, outside):
    os.symlink(outside, root / JOB)
    hook = CheckpointHook(str(root))
    before = snapshot(outside)
    for call in (
        lambda: hook.archive_generation(JOB, 1, now=NOW),
        lambda: hook.list_generations(JOB),
        lambda: hook.copy_generation(JOB, 1, str(root / "copy")),
        lambda: hook.prune_archives(JOB, max_count=0),
        lambda: hook.drop_latest_commit(f"{root}/{JOB}/preflight/x"),
    ):
        with pytest.raises(ValueError, match="outside the checkpoint root"):
            call()
    assert snapshot(outside) == before
    assert not (root / "copy").exists()


def test_symlinked_generation_or_archive_dir_pointing_out_is_rejected(hook, tree, root, outside):
    before = snapshot(outside)
    os.symlink(outside / "gen-1", root / JOB / "gen-3")
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.archive_generation(JOB, 3, now=NOW)
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.list_generations(JOB)
    os.remove(root / JOB / "gen-3")

    os.symlink(outside, root / JOB / "archive")
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.archive_generation(JOB, 1, now=NOW)
    assert (root / JOB / "gen-1" / "offsets" / "2").exists()
    os.remove(root / JOB / "archive")

    (root / JOB / "archive").mkdir()
    os.symlink(outside, root / JOB / "archive" / "gen-1-20200101T000000Z")
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.prune_archives(JOB, max_count=0, now=NOW)
    assert snapshot(outside) == before


def test_symlinks_inside_the_root_are_not_renamed_or_deleted_through(hook, tree, root):
    """A link to another directory of the root must not make the hook move or delete that directory."""
    os.symlink(root / JOB / "gen-2", root / JOB / "gen-5")
    with pytest.raises(ValueError, match="is a link"):
        hook.archive_generation(JOB, 5, now=NOW)
    os.remove(root / JOB / "gen-5")
    keep = hook.archive_generation(JOB, 2, now=NOW)
    os.symlink(keep, root / JOB / "archive" / "gen-9-20200101T000000Z")
    with pytest.raises(ValueError, match="is a link"):
        hook.prune_archives(JOB, max_count=0, now=NOW)
    assert (Path(keep) / "offsets" / "1").exists()


def test_copy_target_through_a_symlink_out_of_the_root_is_rejected(hook, tree, root, outside):
    os.symlink(outside, root / "escape")
    before = snapshot(outside)
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.copy_generation(JOB, 1, str(root / "escape" / "copy"))
    assert snapshot(outside) == before


def test_copy_refuses_a_generation_holding_a_link_out_of_the_root(hook, tree, root, outside):
    os.symlink(outside / "gen-1" / "sources", root / JOB / "gen-1" / "state" / "ext")
    with pytest.raises(ValueError, match="outside the checkpoint root"):
        hook.copy_generation(JOB, 1, str(root / JOB / "preflight" / "x"))
    assert not (root / JOB / "preflight" / "x").exists()


# -- construction ----------------------------------------------------------------------------------------
def test_hook_declares_its_connection_type():
    assert CheckpointHook.conn_name_attr == "checkpoint_conn_id"
    assert CheckpointHook.default_conn_name == "checkpoint_default"
    assert CheckpointHook.conn_type == "stream_checkpoint"
    assert CheckpointHook.hook_name == "Stream checkpoints"


@pytest.mark.parametrize("root_text", ["", "s3://bucket/ck", "hdfs://namenode:8020"])
def test_unsupported_roots_are_rejected(root_text):
    with pytest.raises(ValueError, match="checkpoint_root"):
        CheckpointHook(root_text)


def test_local_root_needs_no_connection(hook, tree):
    with pytest.raises(ValueError, match="local"):
        hook.get_conn()
    assert hook.list_generations(JOB)


# -- HDFS ------------------------------------------------------------------------------------------------
HDFS_CONN = "checkpoint_test_webhdfs"


def hdfs_connection(monkeypatch, url: str) -> None:
    parts = urlsplit(url)
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{HDFS_CONN.upper()}",
        json.dumps(
            {
                "conn_type": "stream_checkpoint",
                "host": parts.hostname,
                "port": parts.port or 9870,
                "login": os.environ.get("WEBHDFS_USER") or getpass.getuser(),
                "extra": {"use_ssl": parts.scheme == "https"},
            }
        ),
    )


def test_hdfs_paths_are_normalised_and_confined(monkeypatch):
    """Path checks come before any request, so they run without a NameNode (the client is real but idle;
    a check that let a path through would try to connect to a closed port and fail differently)."""
    hdfs_connection(monkeypatch, "http://127.0.0.1:9")
    hook = CheckpointHook("hdfs://namenode:8020/checkpoints/", HDFS_CONN)
    assert hook.job_root(JOB) == f"hdfs://namenode:8020/checkpoints/{JOB}"
    assert hook.generation_path(JOB, 4) == f"hdfs://namenode:8020/checkpoints/{JOB}/gen-4"
    for path in [
        f"hdfs://namenode:8020/checkpoints/{JOB}/../../etc/x",
        "hdfs://namenode:8020/elsewhere/x",
        f"hdfs://other:8020/checkpoints/{JOB}/preflight/x",
        "/checkpoints/../tmp/x",
        f"checkpoints/{JOB}/preflight/x",
        f"file:///checkpoints/{JOB}/preflight/x",
        "hdfs://namenode:8020/checkpoints",
    ]:
        with pytest.raises(ValueError) as err:
            hook.drop_latest_commit(path)
        assert repr(path) in str(err.value)
    for path in (
        f"hdfs://namenode:8020/checkpoints/{JOB}/gen-1",
        f"hdfs:///checkpoints/{JOB}/gen-1/commits/..",
    ):
        with pytest.raises(ValueError, match="active gen-"):
            hook.drop_latest_commit(path)
    for job_id in ("../x", "a/b"):
        with pytest.raises(ValueError, match="letters, digits"):
            hook.archive_generation(job_id, 1)


class HdfsTree:
    """Writes the same Spark files on HDFS with the real WebHDFS client (no .crc: HDFS checksums itself)."""

    crc = False

    def __init__(self, client, base: str):
        self.client = client
        self.base = base

    def write(self, rel: str, data: bytes) -> None:
        self.client.write(f"{self.base}/{rel}", data=data, overwrite=False)

    def mkdir(self, rel: str) -> None:
        self.client.makedirs(f"{self.base}/{rel}")

    def exists(self, rel: str) -> bool:
        return self.client.status(f"{self.base}/{rel}", strict=False) is not None

    def read(self, rel: str) -> bytes:
        with self.client.read(f"{self.base}/{rel}") as reader:
            return reader.read()

    def listdir(self, rel: str) -> list[str]:
        return sorted(self.client.list(f"{self.base}/{rel}"))


@pytest.mark.skipif(
    not os.environ.get("WEBHDFS_URL"),
    reason="needs a real HDFS: set WEBHDFS_URL=http://<namenode>:9870 (and WEBHDFS_USER, optionally "
    "HDFS_TEST_DIR, default /tmp)",
)
class TestOnHdfs:
    """The same scenario as on the local filesystem, against a real NameNode through WebHDFS."""

    @pytest.fixture
    def hdfs(self, monkeypatch):
        url = os.environ["WEBHDFS_URL"]
        hdfs_connection(monkeypatch, url)
        base = f"{os.environ.get('HDFS_TEST_DIR', '/tmp').rstrip('/')}/asp-checkpoint-{uuid.uuid4().hex[:10]}"
        hook = CheckpointHook(f"hdfs://{urlsplit(url).hostname}:8020{base}", HDFS_CONN)
        client = hook.webhdfs_client
        client.makedirs(base)
        yield hook, HdfsTree(client, base)
        client.delete(base, recursive=True)

    def test_scenario(self, hdfs):
        hook, tree = hdfs
        run_scenario(hook, tree, hook.checkpoint_root)

    def test_refusals(self, hdfs):
        hook, tree = hdfs
        build_job(tree)
        with pytest.raises(FileNotFoundError, match="generation 7"):
            hook.archive_generation(JOB, 7, now=NOW)
        archived = hook.archive_generation(JOB, 1, now=NOW)
        tree.mkdir(f"{JOB}/gen-1")
        with pytest.raises(FileExistsError, match="already exists"):
            hook.archive_generation(JOB, 1, now=NOW)
        assert tree.exists(f"{JOB}/archive/gen-1-20240501T120000Z/offsets/2")
        assert not tree.exists(f"{JOB}/archive/gen-1-20240501T120000Z/gen-1"), "rename must not nest"
        target = f"{hook.job_root(JOB)}/preflight/p"
        assert hook.copy_generation(JOB, 2, target) == target
        with pytest.raises(FileExistsError, match="already exists"):
            hook.copy_generation(JOB, 2, target)
        with pytest.raises(ValueError, match="outside the checkpoint root"):
            hook.copy_generation(JOB, 2, f"{hook.checkpoint_root}/../escape")
        assert hook.list_generations(JOB)[0].path == archived

    def test_prune(self, hdfs):
        hook, tree = hdfs
        build_job(tree)
        paths = make_archives(hook, tree, [40, 30, 20, 10])
        assert hook.prune_archives(JOB, now=NOW) == []
        assert sorted(hook.prune_archives(JOB, max_count=3, now=NOW)) == paths[:1]
        assert sorted(hook.prune_archives(JOB, max_age_s=15 * DAY, now=NOW)) == sorted(paths[1:3])
        assert [(g.generation, g.archived) for g in hook.list_generations(JOB)] == [
            (1, False),
            (2, False),
            (13, True),
        ]


class _StandInWebHdfs:
    """A WebHDFS endpoint over a few in-memory paths that refuses chosen requests as a NameNode does when
    its user may not read them (403, AccessControlException).  No HDFS runs here; this is the part of the
    protocol the hook's reads use."""

    def __init__(self, files: dict[str, bytes], refused: set[tuple[str, str]]):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs

        dirs = {"/"} | {p.rsplit("/", i)[0] or "/" for p in files for i in range(1, p.count("/") + 1)}

        def status(path: str, suffix: str = "") -> dict:
            kind = "FILE" if path in files else "DIRECTORY"
            return {"pathSuffix": suffix, "type": kind, "length": len(files.get(path, b"")),
                    "modificationTime": 1_714_564_800_000}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, exception: str, message: str) -> None:
                self._answer(code, json.dumps({"RemoteException": {"exception": exception, "message": message}})
                             .encode())

            def do_GET(self):
                url = urlsplit(self.path)
                op, path = parse_qs(url.query)["op"][0], url.path.removeprefix("/webhdfs/v1") or "/"
                if any(op == o and path.startswith(p) for o, p in refused):
                    return self._error(403, "AccessControlException",
                                       f"Permission denied: user=airflow, access=EXECUTE, inode=\"{path}\"")
                if path not in files and path not in dirs:
                    return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
                if op == "GETFILESTATUS":
                    return self._answer(200, json.dumps({"FileStatus": status(path)}).encode())
                if op == "LISTSTATUS":
                    children = sorted({p[len(path.rstrip("/")) + 1:].split("/")[0] for p in files | dict.fromkeys(dirs)
                                       if p.startswith(path.rstrip("/") + "/")} - {""})
                    listed = [status(f"{path.rstrip('/')}/{c}", c) for c in children]
                    return self._answer(200, json.dumps({"FileStatuses": {"FileStatus": listed}}).encode())
                if op == "OPEN":
                    return self._answer(200, files[path], "application/octet-stream")
                return self._error(400, "IllegalArgumentException", f"op {op}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def stand_in_webhdfs(monkeypatch):
    started = []

    def start(files: dict[str, bytes], refused: set[tuple[str, str]]) -> CheckpointHook:
        started.append(_StandInWebHdfs(files, refused))
        hdfs_connection(monkeypatch, started[-1].url)
        return CheckpointHook("hdfs://nn:8020/ck", HDFS_CONN)

    yield start
    for server in started:
        server.server.shutdown()


def test_an_hdfs_checkpoint_the_webhdfs_user_may_not_read_is_not_taken_for_a_missing_one(stand_in_webhdfs):
    """Asked with ``strict=False``, the client answered None for any refusal as for a missing path: an
    upgrade skipped its preflight ("no checkpoint yet"), a reset archived nothing and a diagnosis said the
    checkpoint was lost."""
    hook = stand_in_webhdfs({f"/ck/{JOB}/gen-1/offsets/0": b"v1\n{}\n{}\n"}, {("GETFILESTATUS", f"/ck/{JOB}")})
    with pytest.raises(PermissionError, match="read access"):
        hook.has_checkpoint(hook.generation_path(JOB, 1))
    with pytest.raises(PermissionError):
        hook.list_generations(JOB)


def test_an_unreadable_hdfs_offsets_file_leaves_the_listing_working(stand_in_webhdfs):
    """The local file system's listing reports an unreadable offsets file as unknown offsets; on HDFS the
    client's own error escaped, and one such file in any generation or archive blocked every reset, upgrade
    and prune."""
    offsets = f'v1\n{{"batchWatermarkMs":0,"batchTimestampMs":0}}\n{{"{TOPIC}":{{"0":10}}}}\n'.encode()
    hook = stand_in_webhdfs({f"/ck/{JOB}/gen-1/offsets/0": offsets, f"/ck/{JOB}/gen-1/commits/0": b"v1\n{}\n"},
                            {("OPEN", f"/ck/{JOB}/gen-1/offsets/0")})
    (found,) = hook.list_generations(JOB)
    assert (found.generation, found.latest_batch.batch_id, found.latest_batch.offsets) == (1, 0, None), found


def test_a_webhdfs_endpoint_that_never_answers_fails_the_call_after_the_connections_timeout(monkeypatch):
    """requests waits for ever by default: a half-open NameNode connection held a reset or an upgrade, and
    the job's lease, with no end.  A listening socket that never answers stands in for it."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        monkeypatch.setenv(f"AIRFLOW_CONN_{HDFS_CONN.upper()}", json.dumps(
            {"conn_type": "stream_checkpoint", "host": "127.0.0.1", "port": silent.getsockname()[1],
             "extra": {"timeout": 1}}))
        hook = CheckpointHook("hdfs://nn:8020/ck", HDFS_CONN)
        began = time.monotonic()
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            hook.has_checkpoint(hook.generation_path(JOB, 1))
        assert time.monotonic() - began < 30
    finally:
        silent.close()


@pytest.mark.parametrize(("given", "timeout"), [(None, 120.0), ("", 120.0), ("30", 30.0), (0, None)])
def test_the_checkpoint_connections_timeout_field(monkeypatch, given, timeout):
    """A cleared form field stores null: every HDFS call failed on float(None)."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{HDFS_CONN.upper()}", json.dumps(
        {"conn_type": "stream_checkpoint", "host": "127.0.0.1", "port": 9870, "extra": {"timeout": given}}))
    hook = CheckpointHook("hdfs://nn:8020/ck", HDFS_CONN)
    if timeout is None:
        with pytest.raises(ValueError, match="not a positive number of seconds"):
            _ = hook.webhdfs_client
    else:
        assert hook.webhdfs_client._timeout == (min(timeout, 10.0), timeout)
