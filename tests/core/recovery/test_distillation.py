"""Recovery by distillation from the dense model (casp_core.recovery.teacher): the top-k cache is the dense model's own
distribution, costs what docs/recovery.md says, is refused without the disk for it; training on it brings the
pruned stories260K closer to the dense model, and a cache whose rows are shuffled does worse."""

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from casp_core.artifacts.snapshot import SNAPSHOT_FILE
from casp_core.errors import DiskSpaceTooSmall, InvalidConfig
from casp_core.eval.perplexity import evaluation_text
from casp_core.job.run import TEACHER_WORK, run_job
from casp_core.method import next_token
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.recovery.data import IGNORED, load_training_data
from casp_core.recovery.teacher import (
    TEACHER_FILE,
    check_free_disk,
    compute_teacher,
    distillation_loss,
    labelled_positions,
    load_teacher,
    teacher_fingerprint,
    top_k_logprobs,
)
from casp_core.recovery.train import loss_terms, recover
from casp_core.run import Run
from casp_core.settings import RecoveryConfig
from tests.conftest import DATASETS_DIR, STORIES, small_config

SEQ_LEN = 128
TRAIN_LINES = 300  # 169 windows of 128 tokens: the teacher pass takes about 2 s
SOURCE = {"model": "stories260K", "revision": None, "dtype": "auto"}


def distill_run(**overrides) -> RecoveryConfig:
    settings = {
        "method": "lora",
        "loss": "distill",
        "max_steps": 8,
        "batch_size": 4,
        "grad_accum": 1,
        "max_seq_len": SEQ_LEN,
        "lr": 1e-3,
    }
    return RecoveryConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The dense model, the PTB train head in windows, the teacher cache the dense model wrote, the pruned model."""
    dense, tokenizer = load_model(str(STORIES))
    lines = (DATASETS_DIR / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:TRAIN_LINES]
    path = tmp_path_factory.mktemp("data") / "ptb-train-head.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    data = load_training_data(str(path), tokenizer, max_seq_len=SEQ_LEN, context=512)
    directory = tmp_path_factory.mktemp("teacher")
    teacher = compute_teacher(
        dense, data, distill_run(), directory, teacher_fingerprint(SOURCE, data, distill_run()), device="cpu"
    )
    pruned = prune(copy.deepcopy(dense), tokenizer, small_config(0.5)).model
    return dense, tokenizer, data, teacher, pruned


@torch.no_grad()
def kl_to_dense(dense, model, windows: torch.Tensor) -> float:
    """The mean KL(dense || model) per next-token position of held-out windows: what distillation recovers."""
    teacher = torch.log_softmax(dense(windows).logits.float(), dim=-1)
    student = torch.log_softmax(model(windows).logits.float(), dim=-1)
    return float((teacher.exp() * (teacher - student)).sum(-1).mean())


@pytest.mark.slow
def test_distilling_the_dense_model_beats_a_shuffled_cache(setup):
    dense, tokenizer, data, teacher, pruned = setup
    held_out = evaluation_text(tokenizer, "ptb", SEQ_LEN, datasets_dir=str(DATASETS_DIR), max_windows=8).windows
    recovered, result = recover(copy.deepcopy(pruned), tokenizer, data, distill_run(), device="cpu", teacher=teacher)
    # The rows of other positions: the dense model's distributions, but not of the tokens they are trained at.
    order = torch.randperm(teacher.indices.shape[0], generator=torch.Generator().manual_seed(0))
    shuffled = replace(
        teacher, indices=teacher.indices[order], logprobs=teacher.logprobs[order], rest=teacher.rest[order]
    )
    broken, _ = recover(copy.deepcopy(pruned), tokenizer, data, distill_run(), device="cpu", teacher=shuffled)
    before = kl_to_dense(dense, pruned, held_out)
    after = kl_to_dense(dense, recovered, held_out)
    worse = kl_to_dense(dense, broken, held_out)
    assert after < 0.95 * before, (before, after)
    assert worse > after * 1.03, (after, worse)
    # The curve carries both terms; the loss trained on is the KL alone.
    assert all({"loss", "ce", "kl", "lr"} <= set(point) for point in result.curve)
    assert all(point["loss"] == pytest.approx(point["kl"]) for point in result.curve)
    assert result.teacher["tokens"] == teacher.indices.shape[0] and result.teacher["top_k"] == 64


def test_distill_ce_weighs_the_two_terms(setup):
    _, tokenizer, data, teacher, pruned = setup
    _, result = recover(
        copy.deepcopy(pruned),
        tokenizer,
        data,
        distill_run(loss="distill_ce", ce_weight=0.3, max_steps=1),
        teacher=teacher,
    )
    (point,) = result.curve
    assert point["loss"] == pytest.approx(0.3 * point["ce"] + 0.7 * point["kl"])
    assert point["ce"] > point["kl"] > 0


def test_the_cache_is_the_dense_models_top_k_and_costs_388_bytes_a_token(setup):
    dense, _, data, teacher, _ = setup
    rows = sum(int(labelled_positions(labels).sum()) for labels in data.labels)
    assert teacher.indices.shape == (rows, 64) and teacher.indices.dtype == torch.int16  # a 512-token vocabulary
    # 64 x (2 + 4) + 4 bytes per token, and a header.
    assert 388 * rows < teacher.path.stat().st_size < 388 * rows + 4096
    assert teacher.summary()["bytes_per_token"] == 388
    # Sequence 3's rows are the dense model's own distribution at its positions.
    with torch.no_grad():
        logprobs = torch.log_softmax(dense(data.sequences[3].unsqueeze(0)).logits[0, :-1].float(), dim=-1)
    indices, top, rest = teacher.rows_of([3])
    torch.testing.assert_close(top, logprobs.gather(-1, indices), rtol=0, atol=1e-5)
    torch.testing.assert_close(top, logprobs.topk(64).values, rtol=0, atol=1e-5)
    torch.testing.assert_close(top.exp().sum(-1) + rest.exp(), torch.ones(len(rest)), rtol=0, atol=1e-5)


def test_a_cache_is_used_only_for_what_it_was_computed_from(setup):
    _, _, data, teacher, _ = setup
    directory = teacher.path.parent
    loaded = load_teacher(directory, teacher_fingerprint(SOURCE, data, distill_run()))
    assert loaded is not None and torch.equal(loaded.logprobs, teacher.logprobs)
    assert loaded.seconds == pytest.approx(teacher.seconds)
    for other in (distill_run(temperature=2.0), distill_run(teacher_top_k=32)):
        assert load_teacher(directory, teacher_fingerprint(SOURCE, data, other)) is None
    assert load_teacher(directory, teacher_fingerprint({**SOURCE, "revision": "v2"}, data, distill_run())) is None
    fewer = replace(data, sequences=data.sequences[1:], labels=data.labels[1:])
    assert load_teacher(directory, teacher_fingerprint(SOURCE, fewer, distill_run())) is None


def test_recovery_refuses_a_distillation_loss_without_its_cache(setup):
    _, tokenizer, data, teacher, pruned = setup
    with pytest.raises(InvalidConfig, match=r"^recovery\.loss: distill needs the dense model's distribution"):
        recover(pruned, tokenizer, data, distill_run())
    fewer = replace(data, sequences=data.sequences[1:], labels=data.labels[1:])
    with pytest.raises(InvalidConfig, match=f"^recovery.loss: the teacher cache {TEACHER_FILE} is not of this"):
        recover(pruned, tokenizer, fewer, distill_run(), teacher=teacher)


def test_the_free_disk_is_checked_before_writing(tmp_path: Path):
    with pytest.raises(DiskSpaceTooSmall, match=r"needs 1048576\.00 GiB in .*, which has [\d.]+ [GM]iB free") as error:
        check_free_disk(tmp_path, 2**50)
    assert error.value.code == "disk_space_too_small"
    check_free_disk(tmp_path, 2**20)


def test_the_bucketed_kl_is_exact_with_the_whole_vocabulary_and_zero_for_the_teacher_itself():
    generator = torch.Generator().manual_seed(0)
    teacher_logits, student_logits = torch.randn(2, 5, 16, generator=generator) * 3
    for temperature in (1.0, 2.0):
        teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
        student = torch.log_softmax(student_logits / temperature, dim=-1)
        exact = float((teacher.exp() * (teacher - student)).sum()) * temperature**2
        top = teacher.topk(16)
        rest = torch.full((5,), float("-inf"))
        whole = distillation_loss(student_logits, top.indices, top.values, rest, temperature)
        assert float(whole) == pytest.approx(exact, rel=1e-5)
        # Buckets lose information: the bucketed KL is at most the exact one, and zero for the teacher itself.
        top = teacher.topk(4)
        rest = teacher.scatter(-1, top.indices, float("-inf")).logsumexp(-1)
        assert 0 < float(distillation_loss(student_logits, top.indices, top.values, rest, temperature)) <= exact
        itself = distillation_loss(teacher_logits, top.indices, top.values, rest, temperature)
        assert abs(float(itself)) < 1e-5


def test_the_loss_taken_a_chunk_of_positions_at_a_time_is_the_whole_batch_s(monkeypatch: pytest.MonkeyPatch):
    """Recovery never holds a batch's logits: the loss puts 7 positions at a time through the head (stories260K's
    vocabulary is 512) and recomputes them in the backward pass, and the terms and gradients are the full logits'."""
    model, _ = load_model(str(STORIES))
    lora = LoraConfig(r=4, target_modules=["q_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False)
    student = get_peft_model(model, lora).get_base_model()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 512, (3, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 30:] = 0  # padding: no attention and no label
    labels = input_ids.masked_fill(attention_mask == 0, IGNORED)
    labels[0, :12] = IGNORED  # a prompt: no label
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    positions = labelled_positions(labels)
    with torch.no_grad():
        dense_rows = student(input_ids, attention_mask=attention_mask).logits[:, :-1][positions] * 1.5
    top, rest = top_k_logprobs(dense_rows, 8, 2.0)
    taught = [top.indices, top.values, rest]
    trained = [parameter for parameter in student.parameters() if parameter.requires_grad]

    head_passes = []
    student.lm_head.register_forward_hook(lambda _, inputs, __: head_passes.append(len(inputs[0].flatten(0, -2))))
    monkeypatch.setattr(next_token, "LOGITS_CHUNK_BYTES", 7 * 4 * 512)
    ce, kl = loss_terms(student, batch, taught, 2.0)
    (ce + kl).backward()
    chunked = [parameter.grad.clone() for parameter in trained]
    rows = int(positions.sum())
    chunks = [7] * (rows // 7) + ([rows % 7] if rows % 7 else [])
    # The forward's last position of each sequence, then every chunk forward and again in the backward pass.
    assert head_passes[0] == 3 and sorted(head_passes[1:]) == sorted(2 * chunks) and len(chunks) > 10

    student.zero_grad()
    logits = student(input_ids, attention_mask=attention_mask).logits[:, :-1][positions].float()
    whole_ce = torch.nn.functional.cross_entropy(logits, labels[:, 1:][positions], reduction="sum")
    whole_kl = distillation_loss(logits, *taught, 2.0)
    (whole_ce + whole_kl).backward()
    assert ce.item() == pytest.approx(whole_ce.item(), rel=1e-5)
    assert kl.item() == pytest.approx(whole_kl.item(), rel=1e-5) and kl.item() > 0
    for parameter, gradient in zip(trained, chunked, strict=True):
        scale = gradient.abs().max().item()  # float32 sums in another order: equal to its 1e-4
        assert scale > 0
        torch.testing.assert_close(gradient, parameter.grad, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.slow
def test_a_job_computes_the_cache_once_and_a_retry_after_pruning_finds_or_recomputes_it(setup, tmp_path: Path):
    """The command line's job (no retry folder) keeps nothing of the cache; a job with a retry folder keeps it
    there, a retry uses it (no dense pass), and a retry that lost it loads the dense model again for it alone."""
    training = tmp_path / "ptb-head.txt"
    lines = (DATASETS_DIR / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:40]
    training.write_text("\n".join(lines), encoding="utf-8")
    recovery = distill_run(dataset=str(training), max_steps=2, batch_size=2, max_seq_len=64).to_dict()
    config = small_config(0.5, evaluation={"perplexity": ["wikitext2"], "seq_len": 128, "limit": 2}, recovery=recovery)

    def job(out: str, retry_state: Path | None) -> tuple[dict, list[str]]:
        messages: list[str] = []
        run = Run(progress=lambda stage, fraction, message="": messages.append(message))
        return run_job(str(STORIES), config, tmp_path / out, run, retry_state=retry_state), messages

    report, _ = job("cli", None)
    assert report["recovery"]["teacher"]["top_k"] == 64 and "teacher" in report["timings"]
    assert not (tmp_path / "cli" / TEACHER_WORK).exists()

    state = tmp_path / "state"
    first, _ = job("first", state)
    assert (state / TEACHER_FILE).is_file() and (state / SNAPSHOT_FILE).is_file()
    retried, messages = job("retried", state)
    assert f"teacher: the cache {TEACHER_FILE} kept by an earlier attempt" in messages
    assert not any(message.startswith("teacher: top-64") for message in messages)  # no dense pass
    assert retried["recovery"]["curve"] == first["recovery"]["curve"]
    (state / TEACHER_FILE).unlink()
    recomputed, messages = job("recomputed", state)
    assert any(message.startswith("resumed after pruning") for message in messages)
    assert any(message.startswith("teacher: top-64") for message in messages) and (state / TEACHER_FILE).is_file()
    # The same cache again: the same training.
    losses = [point["loss"] for point in first["recovery"]["curve"]]
    assert [point["loss"] for point in recomputed["recovery"]["curve"]] == pytest.approx(losses, rel=1e-6)
