"""The workers' model cache against the real S3 server: a download enters it whole or not at all, unchanged objects
are not read again, changed ones are, and the least recently used entry goes first, unless a job is using it. What a
download that died left behind goes; what a running download writes stays."""

import fcntl
from pathlib import Path
from typing import Any

import pytest

from casp_core.artifacts.caches import LOCKS, PARTIAL_PREFIX
from casp_core.errors import Cancelled, ModelNotFound
from service.model_sources import ModelCache, local_model, locate
from service.settings import S3Credentials, Settings
from service.storage import S3Location, make_storage
from tests.service_fixtures import DEMO_MODEL, MODELS_BUCKET, started_with
from tests.service_fixtures import put_model as put_objects

pytestmark = pytest.mark.service


def put_model(models_bucket: tuple[Any, S3Credentials], prefix: str) -> S3Location:
    put_objects(models_bucket, prefix)
    return S3Location(MODELS_BUCKET, prefix, models_bucket[1])


def model_bytes() -> int:
    return sum(path.stat().st_size for path in DEMO_MODEL.iterdir())


class Recorder:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.fractions: list[float] = []

    def __call__(self, fraction: float, message: str) -> None:
        self.fractions.append(fraction)
        self.messages.append(message)


def entries(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if not path.name.startswith("."))


def test_a_model_is_downloaded_once_and_again_when_its_objects_change(
    models_bucket: tuple[Any, S3Credentials], tmp_path: Path
) -> None:
    location = put_model(models_bucket, "cache-test/stories260K")
    cache = ModelCache(tmp_path, max_bytes=10 * model_bytes())
    first = Recorder()
    with cache.local_copy(location, first, lambda: False) as folder:
        assert folder.name == "stories260K"  # the model card names a local model by its folder
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in DEMO_MODEL.iterdir())
        assert (folder / "model.safetensors").read_bytes() == (DEMO_MODEL / "model.safetensors").read_bytes()
        weights = (folder / "model.safetensors").stat()
    assert first.messages[-1] == f"downloaded {location}: 6 files, {model_bytes() / 1e6:.1f} MB"
    assert first.fractions == sorted(first.fractions) and first.fractions[-1] == 1.0

    again = Recorder()
    with cache.local_copy(location, again, lambda: False) as folder:
        assert (folder / "model.safetensors").stat().st_ino == weights.st_ino  # the same file: nothing was read
    assert again.messages == [f"{location}: in the model cache, its objects unchanged; nothing downloaded"]

    # A changed object has a new ETag: the model is downloaded anew, into a new entry.
    client, _ = models_bucket
    client.put_object(Bucket=MODELS_BUCKET, Key=f"{location.prefix}/generation_config.json", Body=b"{}")
    changed = Recorder()
    with cache.local_copy(location, changed, lambda: False) as folder:
        assert (folder / "generation_config.json").read_bytes() == b"{}"
    assert changed.messages[-1].startswith("downloaded")
    assert len(entries(tmp_path)) == 2


def test_a_download_cut_short_never_enters_the_cache(models_bucket: tuple[Any, S3Credentials], tmp_path: Path) -> None:
    location = put_model(models_bucket, "cache-test/cut/stories260K")
    cache = ModelCache(tmp_path, max_bytes=10 * model_bytes())
    polls = iter([False, False, True])  # cancelled while the third chunk comes in
    with pytest.raises(Cancelled), cache.local_copy(location, Recorder(), lambda: next(polls)):
        pass
    assert entries(tmp_path) == []
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(PARTIAL_PREFIX)]
    # The next job downloads it whole.
    recorder = Recorder()
    with cache.local_copy(location, recorder, lambda: False) as folder:
        assert (folder / "model.safetensors").read_bytes() == (DEMO_MODEL / "model.safetensors").read_bytes()
    assert recorder.messages[-1].startswith("downloaded")


def fetch(cache: ModelCache, location: S3Location) -> str:
    """What the cache said of the model: downloaded, or found."""
    recorder = Recorder()
    with cache.local_copy(location, recorder, lambda: False):
        pass
    return "found" if recorder.messages[-1].endswith("nothing downloaded") else "downloaded"


def test_the_least_recently_used_model_goes_first_unless_a_job_uses_it(
    models_bucket: tuple[Any, S3Credentials], tmp_path: Path
) -> None:
    first, second, third = (put_model(models_bucket, f"cache-test/lru-{i}/stories260K") for i in range(3))
    room_for_two = 2 * model_bytes() + 1000
    cache = ModelCache(tmp_path / "lru", room_for_two)
    assert [fetch(cache, first), fetch(cache, second), fetch(cache, first)] == ["downloaded", "downloaded", "found"]
    fetch(cache, third)  # the second is the least recently used now
    assert len(entries(tmp_path / "lru")) == 2
    assert [fetch(cache, first), fetch(cache, third), fetch(cache, second)] == ["found", "found", "downloaded"]

    cache = ModelCache(tmp_path / "held", room_for_two)
    with cache.local_copy(first, Recorder(), lambda: False) as held:
        fetch(cache, second)
        fetch(cache, third)  # the first is the least recently used, but a job holds it: the second goes
        assert (held / "model.safetensors").is_file()
    assert len(entries(tmp_path / "held")) == 2
    assert [fetch(cache, first), fetch(cache, third)] == ["found", "found"]


def test_a_partial_download_whose_worker_died_is_removed_and_a_running_one_is_not(
    models_bucket: tuple[Any, S3Credentials], tmp_path: Path
) -> None:
    location = put_model(models_bucket, "cache-test/partials/stories260K")
    cache = ModelCache(tmp_path, max_bytes=10 * model_bytes())
    # A worker killed mid-download leaves its partial folder, and its lock file unlocked (or none at all).
    (tmp_path / LOCKS).mkdir()
    for name, lock_file in (("died-with-lock", True), ("died-before-locking", False)):
        (tmp_path / f"{PARTIAL_PREFIX}{name}" / "stories260K").mkdir(parents=True)
        (tmp_path / f"{PARTIAL_PREFIX}{name}" / "stories260K" / "model.safetensors").write_bytes(b"x" * 1000)
        if lock_file:
            (tmp_path / LOCKS / f"{PARTIAL_PREFIX}{name}").touch()
    # Another worker of this machine is downloading: it holds its partial folder's lock.
    running = tmp_path / f"{PARTIAL_PREFIX}running"
    (running / "stories260K").mkdir(parents=True)
    with (tmp_path / LOCKS / running.name).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert fetch(cache, location) == "downloaded"
        assert [p.name for p in tmp_path.glob(f"{PARTIAL_PREFIX}*")] == [running.name]
        assert sorted(p.name for p in (tmp_path / LOCKS).iterdir() if p.name.startswith(PARTIAL_PREFIX)) == [
            running.name
        ]
        assert fetch(cache, location) == "found"  # a cache hit cleans as well: the running one still stays
        assert running.is_dir()
    # Its worker died: the lock went with it.
    assert fetch(cache, location) == "found"
    assert not list(tmp_path.glob(f"{PARTIAL_PREFIX}*")) and not list((tmp_path / LOCKS).glob(f"{PARTIAL_PREFIX}*"))


def test_a_bucket_is_read_with_its_own_credentials_where_the_settings_name_them(
    models_bucket: tuple[Any, S3Credentials], tmp_path: Path
) -> None:
    location = put_model(models_bucket, "cache-test/credentials/stories260K")
    model = f"s3://{MODELS_BUCKET}/{location.prefix}"
    _, credentials = models_bucket
    # The artifact storage's credentials cannot read the models bucket (another account, say).
    storage_only = Settings(
        home=tmp_path,
        s3_endpoint_url=credentials.endpoint_url,
        s3_access_key_id=credentials.access_key_id,
        s3_secret_access_key="not-the-models-secret",
        allowed_model_buckets=[MODELS_BUCKET],
    )
    with_own = storage_only.model_copy(update={"model_bucket_credentials": {MODELS_BUCKET: credentials}})
    for settings in (storage_only, with_own):
        assert locate(None, model, None, make_storage(settings), settings) == S3Location(  # type: ignore[arg-type]
            MODELS_BUCKET, location.prefix, settings.bucket_credentials(MODELS_BUCKET)
        )
    refused = locate(None, model, None, make_storage(storage_only), storage_only)  # type: ignore[arg-type]
    refusal = r"refused to list it \(SignatureDoesNotMatch\).*CREDENTIALS"
    with pytest.raises(ModelNotFound, match=refusal), local_model(refused, storage_only, Recorder(), lambda: False):
        pass
    recorder = Recorder()
    source = locate(None, model, None, make_storage(with_own), with_own)  # type: ignore[arg-type]
    with local_model(source, with_own, recorder, lambda: False) as folder:
        assert (folder / "model.safetensors").read_bytes() == (DEMO_MODEL / "model.safetensors").read_bytes()
    assert recorder.messages[-1].startswith(f"downloaded {model}")


def test_casp_worker_refuses_a_wrong_bound_of_the_dequantized_gguf_cache_in_one_line(tmp_path: Path) -> None:
    # casp_core reads CASP_CACHE_MAX_BYTES at each GGUF job; a worker checks it at start, before anything is set up.
    variables = {"CASP_HOME": str(tmp_path / "home"), "CASP_CACHE_MAX_BYTES": "100G"}
    started = started_with(["-m", "casp_cli.main", "worker"], variables)
    assert started.returncode == 2
    assert started.stderr == (
        "casp: error: invalid_config: CASP_CACHE_MAX_BYTES: a number of bytes, 0 or more, got '100G'\n"
    )
    assert not (tmp_path / "home").exists()
