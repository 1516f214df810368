"""A Hugging Face id is loaded from the hub cache only, never from a same-named path in the working directory."""

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from casp_core.errors import ModelNotFound
from casp_core.model import load_model, model_source
from tests.conftest import PTBWIKI, STORIES

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real Hugging Face cache (the layout huggingface_hub writes) holding the demo model as `org/tiny`."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    shutil.copytree(STORIES, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def hostile_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory where `org/tiny` and `org/absent` are symlinks to another model, outside any root."""
    cwd = tmp_path / "cwd"
    (cwd / "org").mkdir(parents=True)
    for name in ("tiny", "absent"):
        (cwd / "org" / name).symlink_to(PTBWIKI)
    monkeypatch.chdir(cwd)
    return cwd


def test_a_hub_id_loads_from_the_cache_not_the_working_directory(hub_cache: Path, hostile_cwd: Path) -> None:
    assert model_source("org/tiny") == hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    model, _ = load_model("org/tiny")
    stories_width = load_model(str(STORIES))[0].config.hidden_size
    assert model.config.hidden_size == stories_width != load_model(str(PTBWIKI))[0].config.hidden_size


def test_a_hub_id_missing_from_the_cache_is_not_found_even_if_the_cwd_has_it(
    hub_cache: Path, hostile_cwd: Path
) -> None:
    with pytest.raises(ModelNotFound, match=r"org/absent.*\(for the folder org/absent here, write \./org/absent\)"):
        load_model("org/absent")
    assert load_model("./org/absent")[0].config.hidden_size == load_model(str(PTBWIKI))[0].config.hidden_size


@pytest.mark.parametrize("reference", ["org/..", "org--x/name", "a/b/c"])
def test_malformed_hub_ids_are_refused(reference: str) -> None:
    with pytest.raises(ModelNotFound, match="neither a local path nor a Hugging Face id"):
        model_source(reference)
