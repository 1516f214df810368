"""Recovery (LoRA after pruning) on the real fixture models pruned at 0.5: it lowers perplexity, merges exactly,
keeps a peft adapter, reads text and Alpaca data (loss on the response only), refuses bad data, resumes."""

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.errors import Cancelled, InvalidDataset
from casp_core.eval.perplexity import EvaluationText, evaluation_text, windows_perplexity
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.recovery.data import IGNORED, alpaca_prompt, load_training_data
from casp_core.recovery.train import ADAPTER_DIR, STATE_FILE, recover
from casp_core.run import Run
from casp_core.settings import RecoveryConfig
from tests.conftest import DATASETS_DIR, PTBWIKI, STORIES, small_config

# The first lines of PTB train: the same data as the whole split, read in a fraction of the time.
PTB_TRAIN_LINES = 3000
SEQ_LEN = 128
ALPACA_SEQ_LEN = 256


def pruned_model(path: Path):
    model, tokenizer = load_model(str(path))
    return prune(model, tokenizer, small_config(0.5)).model, tokenizer


@pytest.fixture(scope="module")
def pruned_stories():
    return pruned_model(STORIES)


@pytest.fixture(scope="module")
def pruned_ptbwiki():
    return pruned_model(PTBWIKI)


@pytest.fixture(scope="module")
def ptb_train(tmp_path_factory) -> str:
    lines = (DATASETS_DIR / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:PTB_TRAIN_LINES]
    path = tmp_path_factory.mktemp("data") / "ptb-train-head.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def stories_ptb(pruned_stories, ptb_train):
    """The pruned stories model, its tokenizer and the PTB train head in its windows."""
    pruned, tokenizer = pruned_stories
    return pruned, tokenizer, load_training_data(ptb_train, tokenizer, max_seq_len=SEQ_LEN, context=512)


def short_run(**overrides) -> RecoveryConfig:
    settings = {"method": "lora", "max_steps": 8, "batch_size": 4, "grad_accum": 1, "max_seq_len": SEQ_LEN, "lr": 1e-3}
    return RecoveryConfig(**{**settings, **overrides})


def perplexities(model, texts: list[EvaluationText]) -> dict[str, float]:
    return {text.dataset: windows_perplexity(model, text, device="cpu") for text in texts}


# ptbwiki-7M's recovery (17 s) is make test-slow's: stories260K's shows the same, the real model's is bench/smollm2.py's
@pytest.mark.parametrize("fixture", ["pruned_stories", pytest.param("pruned_ptbwiki", marks=pytest.mark.slow)])
def test_recovery_on_ptb_train_lowers_wikitext2_and_ptb_perplexity(fixture, request, ptb_train):
    pruned, tokenizer = request.getfixturevalue(fixture)
    texts = [
        evaluation_text(tokenizer, name, SEQ_LEN, datasets_dir=str(DATASETS_DIR), max_windows=8)
        for name in ("wikitext2", "ptb")
    ]
    before = perplexities(pruned, texts)
    data = load_training_data(ptb_train, tokenizer, max_seq_len=SEQ_LEN, context=512)
    recovered, result = recover(copy.deepcopy(pruned), tokenizer, data, short_run(), device="cpu")
    after = perplexities(recovered, texts)
    assert after["wikitext2"] < before["wikitext2"], (before, after)
    assert after["ptb"] < before["ptb"], (before, after)
    assert [point["step"] for point in result.curve] == list(range(1, 9))
    assert result.tokens == 8 * 4 * SEQ_LEN and result.tokens_per_second > 0
    assert result.data["layout"] == "text"


def test_merged_checkpoint_and_adapter(stories_ptb, tmp_path):
    pruned, tokenizer, data = stories_ptb
    recovered, result = recover(
        copy.deepcopy(pruned), tokenizer, data, short_run(max_steps=2), adapter_dir=tmp_path / ADAPTER_DIR
    )
    # Merged: the same classes and shapes as the pruned model, no LoRA left; the published format loads it.
    assert type(recovered) is type(pruned)
    shapes = {name: tensor.shape for name, tensor in pruned.state_dict().items()}
    assert {name: tensor.shape for name, tensor in recovered.state_dict().items()} == shapes
    assert not any("lora" in name for name in recovered.state_dict())
    save_pruned(recovered, tokenizer, tmp_path / "checkpoint")
    loaded, _ = load_pruned(tmp_path / "checkpoint")
    batch = torch.arange(1, 65).unsqueeze(0)
    with torch.no_grad():
        merged_logits = loaded(batch).logits
        # The adapter, loaded with peft on the pruned model, gives what the merged weights give.
        adapted = PeftModel.from_pretrained(copy.deepcopy(pruned), tmp_path / ADAPTER_DIR).eval()
        torch.testing.assert_close(adapted(batch).logits, merged_logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(pruned(batch).logits, merged_logits, atol=1e-3)
    assert result.trainable_parameters == sum(p.numel() for name, p in adapted.named_parameters() if "lora_" in name)


def killed_again() -> Run:
    """Cancelled at the start of step 4 (after 3 step reports): the state saved after step 2 is what remains."""
    reports: list[str] = []
    return Run(
        progress=lambda stage, fraction, message="": reports.append(message),
        should_cancel=lambda: len(reports) >= 3,
    )


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(stories_ptb, tmp_path):
    pruned, tokenizer, data = stories_ptb
    config = short_run(max_steps=4, save_every=2, batch_size=2)
    whole, whole_result = recover(copy.deepcopy(pruned), tokenizer, data, config)

    saved: list[Path] = []
    with pytest.raises(Cancelled):
        run = killed_again()
        recover(copy.deepcopy(pruned), tokenizer, data, config, run, state_dir=tmp_path, on_state_saved=saved.append)
    assert saved == [tmp_path / STATE_FILE]  # after step 2, whole: the service copies it to the job's storage
    assert (tmp_path / STATE_FILE).is_file()
    resumed, resumed_result = recover(copy.deepcopy(pruned), tokenizer, data, config, state_dir=tmp_path)
    assert resumed_result.resumed_from_step == 2
    assert [p["loss"] for p in resumed_result.curve] == pytest.approx([p["loss"] for p in whole_result.curve])
    for (name, expected), actual in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6, msg=name)
    # Other settings: the saved state is not theirs, training starts over.
    other_settings = short_run(max_steps=3, save_every=2, batch_size=2)
    _, other = recover(copy.deepcopy(pruned), tokenizer, data, other_settings, state_dir=tmp_path)
    assert other.resumed_from_step is None
    # Other weights (a retry that pruned differently): the same.
    with pytest.raises(Cancelled):
        recover(copy.deepcopy(pruned), tokenizer, data, config, killed_again(), state_dir=tmp_path)
    changed = copy.deepcopy(pruned)
    with torch.no_grad():
        changed.model.norm.weight[0] += 1e-3
    _, restarted = recover(changed, tokenizer, data, config, state_dir=tmp_path)
    assert restarted.resumed_from_step is None


def test_cancelled_before_the_next_forward_pass(stories_ptb):
    pruned, tokenizer, data = stories_ptb
    steps: list[float] = []
    run = Run(progress=lambda stage, fraction, message="": steps.append(fraction), should_cancel=lambda: bool(steps))
    with pytest.raises(Cancelled):
        recover(copy.deepcopy(pruned), tokenizer, data, short_run(max_steps=50), run)
    assert len(steps) == 1


def write_jsonl(path: Path, records: list[object]) -> str:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n", encoding="utf-8")
    return str(path)


ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_alpaca_records_train_on_the_response_only(pruned_stories, tmp_path, suffix):
    _, tokenizer = pruned_stories
    path = tmp_path / f"alpaca{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(ALPACA), encoding="utf-8")
    else:
        write_jsonl(path, ALPACA)
    # The template alone is about 100 tokens of the 512-token vocabulary.
    data = load_training_data(str(path), tokenizer, max_seq_len=ALPACA_SEQ_LEN, context=512)
    assert data.layout == "alpaca" and len(data) == 2
    for record, ids, labels in zip(ALPACA, data.sequences, data.labels, strict=True):
        prompt = [tokenizer.bos_token_id, *tokenizer(alpaca_prompt(record), add_special_tokens=False)["input_ids"]]
        response = [*tokenizer(record["output"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        assert ids.tolist() == prompt + response
        assert labels.tolist() == [IGNORED] * len(prompt) + response
    assert "### Input:\n2 and 3" in alpaca_prompt(ALPACA[1]) and "### Input" not in alpaca_prompt(ALPACA[0])
    # A record whose prompt fills the window has nothing to learn from and is left out, and counted.
    long = tmp_path / "long.jsonl"
    write_jsonl(long, [*ALPACA, {"instruction": "word " * 200, "output": "x"}])
    assert load_training_data(str(long), tokenizer, max_seq_len=ALPACA_SEQ_LEN, context=512).skipped == 1


def test_text_jsonl_is_a_corpus(pruned_stories, tmp_path):
    _, tokenizer = pruned_stories
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "Once upon a time there was a dog. " * 20}] * 4)
    data = load_training_data(path, tokenizer, max_seq_len=64, context=512)
    assert data.layout == "text" and all(len(s) == 64 for s in data.sequences)
    assert all(torch.equal(s, label) for s, label in zip(data.sequences, data.labels, strict=True))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", [ALPACA[0], {"instruction": "no output"}], "missing.jsonl line 2: missing `output`"),
        ("neither.jsonl", [{"prompt": "a"}], "neither.jsonl line 1: a record needs a `text` field"),
        ("typed.jsonl", [{"text": 5}], "typed.jsonl line 1: `text` must be a string"),
        ("empty.txt", b"  \n", "empty.txt: the file is empty"),
        ("latin1.txt", "line one\nna\xefve\n".encode("latin-1"), "latin1.txt line 2: not UTF-8 text"),
        ("broken.jsonl", b'{"text": "a"}\n{"text": \n', "broken.jsonl line 2: not JSON"),
        ("object.json", b'{"text": "a"}', "object.json: a .json file must hold a non-empty array"),
        ("short.txt", b"a few words", "short.txt: "),
    ],
)
def test_bad_data_is_invalid_dataset_naming_where(pruned_stories, tmp_path, name, content, message):
    _, tokenizer = pruned_stories
    path = tmp_path / name
    if isinstance(content, list):
        write_jsonl(path, content)
    else:
        path.write_bytes(content)
    with pytest.raises(InvalidDataset, match="^" + str(tmp_path / message).replace("\\", "\\\\")) as error:
        load_training_data(str(path), tokenizer, max_seq_len=SEQ_LEN, context=512)
    assert error.value.code == "invalid_dataset"


def test_windows_longer_than_the_context_are_refused(pruned_stories):
    _, tokenizer = pruned_stories
    with pytest.raises(InvalidDataset, match="longer than the model's context of 512"):
        load_training_data("ptb", tokenizer, max_seq_len=1024, context=512, datasets_dir=str(DATASETS_DIR))


def test_gradient_checkpointing_trains_the_same_weights(stories_ptb):
    pruned, tokenizer, data = stories_ptb
    plain, _ = recover(copy.deepcopy(pruned), tokenizer, data, short_run(max_steps=2, batch_size=2))
    checkpointed, _ = recover(
        copy.deepcopy(pruned), tokenizer, data, short_run(max_steps=2, batch_size=2, gradient_checkpointing=True)
    )
    for (name, expected), actual in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6, msg=name)
    assert not checkpointed.is_activation_checkpointing


def test_full_fine_tuning_trains_every_decoder_weight_and_nothing_else(stories_ptb, tmp_path):
    pruned, tokenizer, data = stories_ptb
    recovered, result = recover(
        copy.deepcopy(pruned), tokenizer, data, short_run(method="full", max_steps=6, lr=1e-3), adapter_dir=tmp_path
    )
    losses = [point["loss"] for point in result.curve]
    assert losses[-1] < losses[0], losses
    decoder = sum(parameter.numel() for parameter in pruned.model.layers.parameters())
    assert result.trainable_parameters == decoder
    # Every weight of the decoder layers moved; the embedding, the final norm and the head did not.
    before, after = pruned.state_dict(), recovered.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        moved = not torch.equal(after[name], tensor)
        assert moved == name.startswith("model.layers."), name
        assert after[name].dtype == tensor.dtype and after[name].shape == tensor.shape
    assert not recovered.is_activation_checkpointing  # on while training (always, with full), off after
    assert not list(tmp_path.iterdir())  # no adapter to keep
    # The same kind of checkpoint: saved and loaded as a pruned one, the same outputs.
    save_pruned(recovered, tokenizer, tmp_path / "checkpoint")
    loaded, _ = load_pruned(tmp_path / "checkpoint")
    batch = torch.arange(1, 65).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, recovered(batch).logits, rtol=1e-5, atol=1e-5)
