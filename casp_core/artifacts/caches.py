"""Where casp_core keeps what it computes once per model and reuses: a folder it is given (the service's under
CASP_HOME), by default `$CASP_CACHE_DIR`, else `~/.cache/casp`. Each purpose has its subfolder: `gguf/` the GGUF
sources dequantized (casp_core.artifacts.gguf.source), `dense-evaluation/` the dense models' evaluations,
`zero-shot-scores/` the log-likelihoods of zero-shot evaluations in progress (casp_core.eval.evaluate.kept_scores;
those untouched for a week go when the next evaluation keeps scores).

A folder of large entries is a `BoundedCache`: the GGUF sources dequantized (bounded by `$CASP_CACHE_MAX_BYTES`), and
the service's model cache of downloads (service.model_sources). Processes of one machine may share one: an entry is
made in a partial folder and renamed in whole, so one cut short never enters; a process using an entry holds a
shared lock on it; past the bound the least recently used entries go, except those in use."""

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from casp_core.errors import InvalidConfig, ModelNotFound

PARTIAL_PREFIX = ".partial-"
LOCKS = ".locks"
DEFAULT_MAX_BYTES = 100 << 30


def default_cache_dir() -> Path:
    """`$CASP_CACHE_DIR`, else `~/.cache/casp`."""
    configured = os.environ.get("CASP_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "casp"


def cache_max_bytes() -> int:
    """`$CASP_CACHE_MAX_BYTES`, else 100 GiB: what the GGUF sources dequantized may hold on disk (one 7B model in
    bfloat16 is about 14 GB). casp_core reads it wherever it runs, the command line and the service's workers."""
    configured = os.environ.get("CASP_CACHE_MAX_BYTES", "").strip()
    if not configured:
        return DEFAULT_MAX_BYTES
    if not configured.isdigit():
        raise InvalidConfig(f"CASP_CACHE_MAX_BYTES: a number of bytes, 0 or more, got {configured!r}")
    return int(configured)


class BoundedCache:
    """Entries (the folders under `root` whose names do not start with a dot) within `max_bytes`, the least
    recently used out first."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """One process at a time adds, holds or evicts entries."""
        (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
        with (self.root / LOCKS / "cache").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def lock_path(self, entry: str) -> Path:
        return self.root / LOCKS / entry

    def has(self, entry: str) -> bool:
        return (self.root / entry).is_dir()

    @contextlib.contextmanager
    def partial(self) -> Iterator[Path]:
        """A new folder to make an entry in, then `add`; removed with what is left of it when the block ends. Its
        process holds an exclusive lock on it meanwhile: a partial folder whose lock is free was left by a process
        that died, and goes the next time `remove_abandoned_partials` runs."""
        partial = self.root / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
        with self.exclusive():  # the lock is held before the folder exists: a cleaner never sees it free
            making = self.lock_path(partial.name).open("a")
            fcntl.flock(making, fcntl.LOCK_EX)
            partial.mkdir()
        try:
            yield partial
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            self.lock_path(partial.name).unlink(missing_ok=True)
            making.close()

    def add(self, partial: Path, entry: str) -> None:
        """The partial folder made whole as `entry`; if another process added the entry meanwhile, that copy is as
        good and the partial folder goes."""
        with self.exclusive():
            if not self.has(entry):
                partial.rename(self.root / entry)

    @contextlib.contextmanager
    def held(self, entry: str, evicted: str) -> Iterator[Path]:
        """The entry's folder, held while the block runs: a shared lock on it, which eviction leaves alone, its use
        recorded, and the least recently used other entries out until the cache is within its bound. An entry
        evicted since it was made (between two locks: rare, and a retry makes it again) is ModelNotFound(`evicted`)."""
        with self.exclusive():
            if not self.has(entry):
                raise ModelNotFound(evicted)
            use = self.lock_path(entry).open("a")
            fcntl.flock(use, fcntl.LOCK_SH)
            os.utime(self.root / entry)  # least recently used goes first: the modification time is the use
            self.evict(keep=entry)
        try:
            yield self.root / entry
        finally:
            use.close()

    def remove_abandoned_partials(self) -> None:
        """Under `exclusive`: the partial folders whose lock is free, their process having died (the lock went with
        it)."""
        for partial in self.root.glob(f"{PARTIAL_PREFIX}*"):
            with self.lock_path(partial.name).open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # still being made
                    continue
                shutil.rmtree(partial, ignore_errors=True)
                self.lock_path(partial.name).unlink()

    def evict(self, keep: str) -> None:
        """Under `exclusive`: least recently used entries out, until the cache is within its bound; entries in use
        stay."""
        entries = [path for path in self.root.iterdir() if path.is_dir() and not path.name.startswith(".")]
        sizes = {path: sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) for path in entries}
        total = sum(sizes.values())
        for path in sorted(entries, key=lambda p: p.stat().st_mtime):
            if total <= self.max_bytes:
                return
            if path.name == keep:
                continue
            with self.lock_path(path.name).open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a process is using it
                    continue
                shutil.rmtree(path)
                self.lock_path(path.name).unlink()
            total -= sizes[path]
