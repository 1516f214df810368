"""What the family tests of OLMo 2 and Granite share: written checkpoints' logits computed in a fresh process that
never imports casp_core (as a user loads them), and a short LoRA recovery run on a pruned model."""

import copy
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.model import load_model
from casp_core.recovery.train import recover
from casp_core.settings import LORA_TARGETS, RecoveryConfig
from tests.conftest import REPO
from tests.core.families.helpers import VOCAB, WINDOW, prune_small, small_training_data
from tests.core.fresh_process import run_python

# The lowest transformers the project supports, installed apart from the venv by `make install`.
LOWEST_TRANSFORMERS = REPO / ".venv" / "transformers-lowest"

_LOGITS = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM
tokens, out = torch.load(sys.argv[1]), {}
for spec in sys.argv[3:]:
    path, trust = spec.rsplit(":", 1)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust == "remote").eval().double()
    with torch.no_grad():
        out[path] = model(tokens, use_cache=False).logits
    print(json.dumps({"checkpoint": path, "class": type(model).__name__, "transformers": transformers.__version__}))
torch.save(out, sys.argv[2])
print(json.dumps({"casp_core_imported": "casp_core" in sys.modules}))
"""


def test_tokens() -> torch.Tensor:
    """The inputs `assert_computes_the_same` compares logits on: past the sliding window of the other families."""
    return torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(3))


test_tokens.__test__ = False  # a helper, not a test


def fresh_logits(
    checkpoints: dict[Path, bool], cwd: Path, *, lowest: bool = False
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Each checkpoint's float64 logits on `test_tokens()`, loaded with `trust_remote_code` as given, in one fresh
    process (under the lowest supported transformers with `lowest`); and what the process printed (the class
    each loaded as, the transformers version, whether casp_core was imported)."""
    torch.save(test_tokens(), cwd / "tokens.pt")
    specs = [f"{path}:{'remote' if remote else 'plain'}" for path, remote in checkpoints.items()]
    if lowest:
        assert LOWEST_TRANSFORMERS.is_dir(), f"{LOWEST_TRANSFORMERS} is missing: run `make install`"
    first = LOWEST_TRANSFORMERS if lowest else None
    completed = run_python(_LOGITS, "tokens.pt", "logits.pt", *specs, cwd=cwd, first_on_path=first)
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    return torch.load(cwd / "logits.pt"), records


@torch.no_grad()
def masked_logits(masked: PreTrainedModel) -> torch.Tensor:
    return copy.deepcopy(masked).double()(test_tokens(), use_cache=False).logits


def assert_recovery_trains_and_reloads(
    pruned: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path
) -> None:
    """Two LoRA steps on every one of the seven projections of the pruned model (whatever each layer kept): the
    merged model keeps the pruned shapes and class, computes something else, and loads back as it was saved (into
    `folder`, beside its training text)."""
    data = small_training_data(tokenizer, folder)
    config = RecoveryConfig(method="lora", max_steps=2, batch_size=2, grad_accum=1, max_seq_len=32, lr=1e-2)
    recovered, result = recover(copy.deepcopy(pruned), tokenizer, data, config, device="cpu")
    assert type(recovered) is type(pruned) and result.steps == 2
    shapes = {name: tensor.shape for name, tensor in pruned.state_dict().items()}
    assert {name: tensor.shape for name, tensor in recovered.state_dict().items()} == shapes
    rank = config.rank
    adapted = [m for layer in pruned.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert {name.rsplit(".", 1)[-1] for name, _ in pruned.model.layers[0].named_modules()} >= set(LORA_TARGETS)
    expected = sum(rank * (m.in_features + m.out_features) for m in adapted)
    assert result.trainable_parameters == expected
    save_pruned(recovered, tokenizer, folder / "recovered")
    loaded = load_pruned(folder / "recovered")[0]
    tokens = test_tokens()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, recovered(tokens).logits)
        assert not torch.allclose(pruned(tokens).logits, recovered(tokens).logits)


def pipeline_checkpoints_of(dense_folder: Path, root: Path) -> dict[str, tuple]:
    """Per shape, the masked dense model's logits, the written checkpoint of the real pipeline at 0.5 under `root`,
    the pruned model and the tokenizer."""
    written = {}
    for shape in ("per_layer", "uniform"):
        model, tokenizer = load_model(str(dense_folder))
        result = prune_small(model, tokenizer, 0.5, "greedy", shape=shape)  # masks `model`
        save_pruned(result.model, tokenizer, root / shape)
        written[shape] = (masked_logits(model), root / shape, result.model, tokenizer)
    return written
