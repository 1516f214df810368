"""Written checkpoints generate what the masked model generates, with the cache as without it, on every family.

transformers 5.24 renamed the cache argument its decoder layers pass to attention; the pruned modeling file then
never filled the cache, and every pruned checkpoint generated garbage with `generate()`'s default (#30). These
tests load each checkpoint the way a user does, in a fresh process that never imports casp_core
(tests/core/generation_parity.py), under the locked transformers and under the lowest version the project
supports (installed beside the venv by `make install`, see the Makefile), with eager and SDPA attention.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from casp_core.artifacts.checkpoint import save_pruned
from casp_core.method.surgery import LayerPruning, remove_units
from casp_core.model import attention_geometry, decoder_layers, load_model
from tests.conftest import REPO
from tests.core.families.helpers import WIDTH, chosen_prunings, masked_copy, write_dense
from tests.core.families.test_families import FAMILIES

SCRIPT = Path(__file__).parents[1] / "generation_parity.py"
# The lowest transformers in requirements.txt's range, with the hub and tokenizers it takes, installed apart from
# the venv (`make install`); the fresh process reads it first.
LOWEST_TRANSFORMERS = REPO / ".venv" / "transformers-lowest"
VERSIONS = ("locked", "lowest")


def uniform_prunings(num_heads: int, num_kv_heads: int, layers: int) -> list[LayerPruning]:
    """The same units in every layer, the last half of each key/value group's query heads: what the uniform shape
    (the family's own class) can hold."""
    group = num_heads // num_kv_heads
    if group == 1:  # multi-head attention: every other head
        heads = tuple(range(1, num_heads, 2))
    else:
        heads = tuple(q for q in range(num_heads) if q % group >= group // 2)
    return [LayerPruning(heads, tuple(range(0, WIDTH, 3)))] * layers


def written_checkpoints(family: str, root: Path) -> dict[str, tuple[Path, Path]]:
    """Per shape, the masked dense model (the reference) and the pruned checkpoint: per layer (uneven groups, a
    layer with no head, a whole group gone) and uniform (the family's own class)."""
    model, tokenizer = load_model(str(write_dense(FAMILIES[family](), root / "dense")))
    geometry = attention_geometry(model, decoder_layers(model)[0])
    prunings = {
        "per_layer": chosen_prunings(geometry.num_heads),
        "uniform": uniform_prunings(geometry.num_heads, geometry.num_kv_heads, len(decoder_layers(model))),
    }
    pairs = {}
    for shape, pruning in prunings.items():
        reference, checkpoint = root / f"masked-{shape}", root / shape
        masked_copy(model, pruning).save_pretrained(reference)
        save_pruned(remove_units(model, pruning, plain=shape == "uniform"), tokenizer, checkpoint)
        pairs[shape] = (reference, checkpoint)
    return pairs


def start_parity(pairs: list[tuple[Path, Path]], version: str, cwd: Path) -> subprocess.Popen[str]:
    """The script in a fresh process, from a folder where casp_core cannot be imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if version == "lowest":
        assert LOWEST_TRANSFORMERS.is_dir(), f"{LOWEST_TRANSFORMERS} is missing: run `make install`"
        env["PYTHONPATH"] = str(LOWEST_TRANSFORMERS)
    command = [sys.executable, str(SCRIPT), *(f"{reference}:{checkpoint}" for reference, checkpoint in pairs)]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parity_records(outcome: subprocess.CompletedProcess[str]) -> list[dict]:
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    return [json.loads(line) for line in outcome.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[Path, Path]]]:
    root = tmp_path_factory.mktemp("generation")
    return {family: written_checkpoints(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def outcomes(
    checkpoints: dict[str, dict[str, tuple[Path, Path]]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every family's records under each transformers version, one fresh process per version, side by side. The
    uniform shape is transformers' own class, so the lowest version runs the per-layer checkpoints alone."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    pairs = {
        "locked": [pair for shapes in checkpoints.values() for pair in shapes.values()],
        "lowest": [shapes["per_layer"] for shapes in checkpoints.values()],
    }
    processes = {version: start_parity(pairs[version], version, cwd) for version in VERSIONS}
    done = {}
    for version, process in processes.items():
        stdout, stderr = process.communicate(timeout=900)
        done[version] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def lowest_supported_transformers() -> str:
    requirement = next(
        line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("transformers")
    )
    return requirement.split(">=")[1].split(",")[0].strip()


def kept_kv_heads(checkpoint: Path) -> tuple[list[int], int]:
    """Each layer's key/value heads and the head size, as the checkpoint's config.json says."""
    config = json.loads((checkpoint / "config.json").read_text())
    per_layer = config.get("layer_num_kv_heads") or [config["num_key_value_heads"]] * config["num_hidden_layers"]
    return per_layer, config["head_dim"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_checkpoints_generate_as_the_masked_model(
    family: str,
    version: str,
    checkpoints: dict[str, dict[str, tuple[Path, Path]]],
    outcomes: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    shape_of = {str(checkpoint): shape for shape, (_, checkpoint) in checkpoints[family].items()}
    mine = [record for record in parity_records(outcomes[version]) if record["checkpoint"] in shape_of]
    shapes = ("per_layer", "uniform") if version == "locked" else ("per_layer",)
    assert sorted((shape_of[r["checkpoint"]], r["attention"]) for r in mine) == [
        (shape, attention) for shape in shapes for attention in ("eager", "sdpa")
    ]
    dense_class = json.loads((checkpoints[family]["uniform"][0] / "config.json").read_text())["architectures"][0]
    for record in mine:
        shape = shape_of[record["checkpoint"]]
        where = f"{family}, {shape}, {record['attention']}, transformers {record['transformers']}"
        assert not record["casp_core_imported"], where
        if version == "lowest":
            assert record["transformers"] == lowest_supported_transformers(), where
        assert record["class"] == ("CaspLlamaForCausalLM" if shape == "per_layer" else dense_class), where
        assert record["cached"][1] == record["uncached"], where
        assert record["cached"] == record["reference"], where
        assert record["batched_float32"] == record["alone_float32"], where
        assert len({token for tokens in record["cached"] for token in tokens}) > 3, where  # not one token repeated
        # The cache holds only the kept key/value heads of each layer; a layer with no head keeps a one-channel
        # placeholder that carries the sequence length.
        kv_heads, head_dim = kept_kv_heads(Path(record["checkpoint"]))
        expected = [[1, heads, 6, head_dim] if heads else [1, 1, 6, 1] for heads in kv_heads]
        assert record["cache_shapes"] == expected, where
    assert kept_kv_heads(checkpoints[family]["per_layer"][1])[0][1] == 0  # a layer that lost every head is among them
