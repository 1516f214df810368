"""Turns `docker-compose config` of docker-compose.yml into the variant check.py runs here.

This machine has a Docker engine but no GPU and no container registry, so exactly these things change and the
rest (our image's build, commands, environment, health checks, dependencies, volumes, ports, restart policies)
runs as written:
- redis, postgres, minio and minio-init use the locally built stand-ins of standins.Dockerfile; minio's
  command and health check and minio-init's entrypoint become SeaweedFS's and boto3's equivalents;
- our image is built FROM the stand-in Python base and tagged casp:check;
- the worker gives up its GPU reservation and serves the CPU queue;
- ./models and ./datasets are the check's own folders.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

STANDIN = "casp-check/{}"
IMAGE = "casp:check"
TCP_CHECK = "import socket; socket.create_connection(('127.0.0.1', 9000), 2)"


def mount_source(volume: str | dict[str, Any], sources: dict[str, Path]) -> str | dict[str, Any]:
    """The volume with its host folder swapped when it mounts one of `sources` (container path -> host path)."""
    if isinstance(volume, dict):
        target = volume.get("target")
        return {**volume, "source": str(sources[target])} if target in sources else volume
    host, _, rest = volume.partition(":")
    target = rest.split(":")[0]
    return f"{sources[target]}:{rest}" if target in sources and host.startswith("/") else volume


def derive(config: dict[str, Any], work: Path) -> dict[str, Any]:
    services = config["services"]
    sources = {"/models": work / "models", "/datasets": work / "datasets"}

    api = services["api"]
    build = api["build"] if isinstance(api["build"], dict) else {"context": api["build"]}
    api["build"] = {**build, "args": {**build.get("args", {}), "BASE_IMAGE": STANDIN.format("python")}}
    api["image"] = IMAGE
    worker = services["worker"]
    worker["image"] = IMAGE
    del worker["deploy"]  # the GPU reservation: no GPU here
    worker["command"] = [arg if arg != "cuda" else "cpu" for arg in worker["command"]]
    worker["healthcheck"]["test"] = [part.replace("casp-cuda@", "casp-cpu@") for part in worker["healthcheck"]["test"]]
    for service in (api, worker):
        service["environment"]["CASP_DEFAULT_DEVICE"] = "cpu"
        service["volumes"] = [mount_source(volume, sources) for volume in service.get("volumes", [])]

    services["redis"]["image"] = STANDIN.format("redis")
    services["postgres"]["image"] = STANDIN.format("postgres")
    minio = services["minio"]
    minio["image"] = STANDIN.format("s3")
    minio["command"] = ["server", "/data"]
    minio["healthcheck"]["test"] = ["CMD", "python", "-c", TCP_CHECK]
    init = services["minio-init"]
    init["image"] = STANDIN.format("s3")
    init["entrypoint"] = ["/usr/local/bin/s3-entrypoint.sh", "make-bucket", "http://minio:9000", "casp"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="the check's folder (models/, datasets/)")
    args = parser.parse_args()
    config = yaml.safe_load(sys.stdin)
    yaml.safe_dump(derive(config, args.work.resolve()), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
