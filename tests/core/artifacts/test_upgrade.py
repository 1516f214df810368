"""`casp upgrade` on a checkpoint as casp 0.1.0 handed them out: a freshly pruned stories260K carrying casp 0.1.0's
modeling file (tests/core/fixtures/modeling_casp_llama_0_1_0.py). With the installed transformers its greedy
generation with the cache differs from generation without it; after the upgrade both are the old uncached one, the
weights' bytes unchanged and the replaced files in the backup. Generation is checked as a user runs it: a fresh
process where casp_core cannot be imported (tests/core/fresh_process.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from casp_core.artifacts.upgrade import BACKUP_DIR, compare
from casp_core.cli.main import main
from casp_core.errors import VerificationFailed
from casp_core.job.run import run_job
from tests.conftest import REPO, STORIES, tiny_config
from tests.core.fresh_process import run_python

# slow (`make test-slow`): casp 0.1.0's checkpoints; the upgrade of its modeling file is unchanged since it landed.
pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "modeling_casp_llama_0_1_0.py"
MODELING_FILE = "modeling_casp_llama.py"
# The upgraded config keeps every setting of the old one, these two excepted: they name the writer's classes and
# transformers version.
RENEWED_SETTINGS = ("auto_map", "transformers_version")
GENERATE = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
inputs = tokenizer("Once upon a time", return_tensors="pt")
greedy = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False}
cached = model.generate(**inputs, use_cache=True, **greedy)[0].tolist()
print(json.dumps({"cached": cached, "uncached": model.generate(**inputs, use_cache=False, **greedy)[0].tolist()}))
"""


def old_modeling_file() -> str:
    """The file as casp 0.1.0 shipped it: the fixture without its header."""
    source = FIXTURE.read_text(encoding="utf-8")
    return source[source.index('"""') :]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A per-layer and a uniform-shape job's output."""
    root = tmp_path_factory.mktemp("pruned")
    for shape in ("per_layer", "uniform"):
        run_job(str(STORIES), tiny_config(0.3, shape=shape), root / shape)
    return {shape: root / shape for shape in ("per_layer", "uniform")}


@pytest.fixture
def old(pruned: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the per-layer checkpoint with casp 0.1.0's modeling file."""
    checkpoint = tmp_path / "stories260K-casp-30"
    shutil.copytree(pruned["per_layer"], checkpoint)
    (checkpoint / MODELING_FILE).write_text(old_modeling_file(), encoding="utf-8")
    return checkpoint


def generations(checkpoint: Path, cwd: Path) -> dict[str, list[int]]:
    """Greedy token ids from "Once upon a time", with the cache and without."""
    completed = run_python(GENERATE, str(checkpoint), cwd=cwd)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.splitlines()[-1])


def upgrade(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["upgrade", str(checkpoint)])
    out, err = capsys.readouterr()
    return status, out, err


def files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_upgrade_makes_generation_with_the_cache_right_and_touches_only_the_modeling_file_and_config(
    old: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = files(old)
    generated = generations(old, tmp_path)
    assert generated["cached"] != generated["uncached"]  # the broken cache, with the installed transformers
    # Verification refuses such generation (the logits compared here are equal: only the cache is at fault).
    measured = {name: torch.tensor(tokens) for name, tokens in generated.items()} | {"logits": torch.zeros(1)}
    with pytest.raises(VerificationFailed, match="other greedy tokens with the cache than without it"):
        compare(measured, measured)

    status, out, err = upgrade(old, capsys)
    assert status == 0, err
    summary = json.loads(out)
    assert summary["status"] == "upgraded" and summary["cached_generation_was_right"] is False
    assert summary["max_logit_difference"] <= 1e-4
    backup = Path(summary["backup"])
    assert backup.parent == old / BACKUP_DIR and str(backup) in summary["message"]

    after = files(old)
    assert after["model.safetensors"] == before["model.safetensors"]
    changed = {name for name, content in after.items() if before.get(name) != content}
    replaced = {name for name in changed if not name.startswith(f"{BACKUP_DIR}/")}
    assert replaced == set(summary["files"]) and MODELING_FILE in replaced <= {"config.json", MODELING_FILE}
    assert changed - replaced == {str((backup / name).relative_to(old)) for name in replaced}
    for name in replaced:
        assert (backup / name).read_bytes() == before[name]
    assert after[MODELING_FILE] == (REPO / "casp_core" / MODELING_FILE).read_bytes()
    old_config, new_config = json.loads(before["config.json"]), json.loads(after["config.json"])
    assert {key: value for key, value in old_config.items() if key not in RENEWED_SETTINGS} == {
        key: new_config.get(key) for key in old_config if key not in RENEWED_SETTINGS
    }
    assert new_config["auto_map"] == {
        "AutoConfig": "modeling_casp_llama.CaspLlamaConfig",
        "AutoModelForCausalLM": "modeling_casp_llama.CaspLlamaForCausalLM",
    }

    upgraded = generations(old, tmp_path)
    assert upgraded["cached"] == upgraded["uncached"] == generated["uncached"]

    status, out, _ = upgrade(old, capsys)  # again: nothing to do
    assert status == 0 and json.loads(out)["status"] == "up_to_date"
    assert files(old) == after


def test_an_upgrade_that_would_change_the_logits_puts_the_old_files_back(
    old: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A modeling file edited by hand to compute something else (attention scores scaled by head_dim^-0.25): the
    # current class computes other logits from the same weights, so the upgrade must not go through.
    modeling = old / MODELING_FILE
    edited = modeling.read_text(encoding="utf-8").replace("self.head_dim**-0.5", "self.head_dim**-0.25")
    assert "head_dim**-0.25" in edited
    modeling.write_text(edited, encoding="utf-8")
    before = files(old)

    status, out, err = upgrade(old, capsys)
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"casp: error: verification_failed: upgrade of {old} failed: ")
    assert "uncached logits differ from the old ones" in err and err.endswith("the old files are back\n")
    assert files(old) == before  # and no backup folder left behind


def test_a_plain_checkpoint_needs_no_upgrade_and_a_folder_without_config_gets_one_line(
    pruned: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = pruned["uniform"]
    before = files(plain)
    status, out, _ = upgrade(plain, capsys)
    summary = json.loads(out)
    assert status == 0 and summary["status"] == "not_casp"
    assert "'llama' (LlamaForCausalLM)" in summary["message"] and "nothing to upgrade" in summary["message"]
    assert files(plain) == before

    status, out, err = upgrade(tmp_path, capsys)
    assert status == 2 and out == ""
    assert err == f"casp: error: model_not_found: {tmp_path} is not a checkpoint directory (no config.json)\n"


def test_a_checkpoint_that_cannot_be_written_gets_one_line_and_keeps_its_files(
    old: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing the new modeling file fails (a read-only file, a full disk): one line, the backup removed."""
    before = files(old)
    writes: list[str] = []

    def refused(path: Path, data: bytes) -> int:
        writes.append(path.name)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "write_bytes", refused)
    status, out, err = upgrade(old, capsys)
    monkeypatch.undo()
    assert writes == [MODELING_FILE]
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        f"casp: error: checkpoint_not_writable: cannot upgrade {old} in place"
    )
    assert err.endswith("nothing was changed\n")
    assert files(old) == before
