"""What the evaluation tests share: the real model and data sets of shared/fixtures, a network guard,
and one torch thread while they run (conftest.py sets the offline environment)."""

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

FIXTURES = Path(os.environ.get("CASP_FIXTURES", REPO.parent / "shared" / "fixtures"))
DATASETS_DIR = FIXTURES / "data"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Imported by each evaluation test module. The test machines share two cores between several test
    runs: with two threads, every small matmul waits at its barrier for a busy core (measured under such
    load: 14 ms a stories260K forward with one thread, 360 ms with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def datasets_dir_or_skip() -> Path:
    if not (DATASETS_DIR / "zeroshot").is_dir():
        pytest.skip(f"zero-shot fixtures not found under {DATASETS_DIR} (set CASP_FIXTURES)")
    return DATASETS_DIR


@contextmanager
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every attempt to open a connection or resolve a name fails and is recorded in the yielded list."""
    attempts: list[str] = []

    def refuse(what: str) -> Callable[..., None]:
        def refused(*args: object, **kwargs: object) -> None:
            attempts.append(f"{what}{args[1:] if what == 'connect' else args}")
            raise OSError(f"network disabled in this test ({what})")

        return refused

    with monkeypatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse("connect"))
        patch.setattr(socket.socket, "connect_ex", refuse("connect"))
        patch.setattr(socket, "create_connection", refuse("create_connection"))
        patch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
        yield attempts
