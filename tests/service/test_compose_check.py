"""derive.py, which scripts/compose_check/check.py uses to run docker-compose.yml here: it must change only what
it says (stand-in images, no GPU, the check's folders) and must keep up with docker-compose.yml's shape."""

import copy
import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("derive", REPO / "scripts/compose_check/derive.py")
assert spec and spec.loader
derive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(derive)


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_the_real_file_asks_for_a_pinned_gpu_and_the_cuda_queue() -> None:
    worker = compose()["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}
    assert worker["command"][-2:] == ["--device", "cuda"]
    assert "casp-cuda@" in worker["healthcheck"]["test"][1]


def test_derive_changes_only_what_it_documents(tmp_path: Path) -> None:
    original = compose()
    derived = derive.derive(copy.deepcopy(original), tmp_path)
    before, after = original["services"], derived["services"]
    assert set(after) == set(before)

    api, worker = after["api"], after["worker"]
    assert api["build"] == {"context": before["api"]["build"], "args": {"BASE_IMAGE": "casp-check/python"}}
    assert api["image"] == worker["image"] == "casp:check"
    assert "deploy" not in worker
    assert worker["command"] == [*before["worker"]["command"][:-1], "cpu"]
    assert worker["healthcheck"]["test"][1] == before["worker"]["healthcheck"]["test"][1].replace("cuda", "cpu")
    for name in ("api", "worker"):
        assert after[name]["environment"]["CASP_DEFAULT_DEVICE"] == "cpu"
        assert {k: v for k, v in after[name]["environment"].items() if k != "CASP_DEFAULT_DEVICE"} == {
            k: v for k, v in before[name]["environment"].items() if k != "CASP_DEFAULT_DEVICE"
        }
        mounts = [volume for volume in after[name]["volumes"] if not volume.startswith("hf-cache")]
        # The raw file's ./models is relative; docker-compose config makes it absolute, which derive rewrites.
        assert mounts == before[name]["volumes"][: len(mounts)]

    for name, standin in (("redis", "redis"), ("postgres", "postgres"), ("minio", "s3"), ("minio-init", "s3")):
        assert after[name]["image"] == f"casp-check/{standin}"
    assert after["minio"]["command"] == ["server", "/data"]
    assert after["minio-init"]["entrypoint"][1:] == ["make-bucket", "http://minio:9000", "casp"]

    # Everything not named above is as written: dependencies, health checks, ports, restarts, volumes.
    untouched = {"image", "build", "command", "deploy", "environment", "volumes", "entrypoint", "healthcheck"}
    for name in before:
        assert {k: v for k, v in after[name].items() if k not in untouched} == {
            k: v for k, v in before[name].items() if k not in untouched
        }
    for name in ("api", "redis", "postgres"):
        assert after[name]["healthcheck"] == before[name]["healthcheck"]
    assert derived["volumes"] == original["volumes"]


def test_derive_points_absolute_mounts_at_the_check_folder(tmp_path: Path) -> None:
    sources = {"/models": tmp_path / "models", "/datasets": tmp_path / "datasets"}
    assert derive.mount_source("/repo/models:/models:ro", sources) == f"{tmp_path}/models:/models:ro"
    assert derive.mount_source("hf-cache:/data/hf:rw", sources) == "hf-cache:/data/hf:rw"
    long_form = {"type": "bind", "source": "/repo/datasets", "target": "/datasets", "read_only": True}
    assert derive.mount_source(long_form, sources) == {**long_form, "source": str(tmp_path / "datasets")}
