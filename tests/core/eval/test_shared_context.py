"""SharedContextLM against the harness's own HFLM, request by request, on the seven tasks' first documents of the
real data: the same log-likelihoods and greedy flags for stories260K dense and pruned at 0.5 (uneven heads per
layer), with requests longer than the model reads handed back to the harness; and each context read once."""

from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from casp_core.eval.shared_context import SharedContextLM, shares_contexts
from casp_core.eval.zeroshot import datasets_offline, task_manager
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.settings import ZERO_SHOT_TASKS
from tests.conftest import STORIES, small_config
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)

DOCUMENTS = 12


@pytest.fixture(scope="module")
def requests_by_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Instance]]:
    """Each task's log-likelihood requests for its first DOCUMENTS documents, as the harness builds them."""
    datasets_dir = str(datasets_dir_or_skip())
    with datasets_offline():
        manager = task_manager(list(ZERO_SHOT_TASKS), datasets_dir, Path(tmp_path_factory.mktemp("tasks")))
        tasks = manager.load(list(ZERO_SHOT_TASKS))["tasks"]
        for task in tasks.values():
            task.build_all_requests(limit=DOCUMENTS, rank=0, world_size=1)
    return {name: list(task.instances) for name, task in tasks.items()}


@pytest.fixture(scope="module")
def stories_dense_and_pruned():
    dense, tokenizer = load_model(str(STORIES))
    masked, _ = load_model(str(STORIES))
    pruned = prune(masked, tokenizer, small_config(0.5)).model
    assert len({layer.self_attn.num_heads for layer in pruned.model.layers}) > 1
    return {"dense": dense, "pruned at 0.5": pruned}, tokenizer


@pytest.mark.parametrize("which", ["dense", "pruned at 0.5"])
def test_the_same_answers_as_the_harness(requests_by_task, stories_dense_and_pruned, which):
    models, tokenizer = stories_dense_and_pruned
    model = models[which]
    arguments = {"pretrained": model, "tokenizer": tokenizer, "batch_size": 3}
    harness, ours = HFLM(**arguments), SharedContextLM(**arguments)
    requests = [
        (request.args, *harness._encode_pair(*request.args))
        for task in ZERO_SHOT_TASKS
        for request in requests_by_task[task]
    ]
    # The tasks' answers are rarely what this small model would say: add a few it would, three tokens it decodes
    # greedily after some of arc_easy's questions, so that the greedy flags are compared where they are True.
    questions = [request.args[0] for request in requests_by_task["arc_easy"][::4]]
    for question in questions:
        context = harness.tok_encode(question)
        with torch.no_grad():
            decoded = model.generate(torch.tensor([context]), max_new_tokens=3, do_sample=False)[0, len(context) :]
        requests.append((None, context, decoded.tolist()))
    # The contexts are shared for these requests (hellaswag's and arc's dominate), not handed to the harness.
    assert shares_contexts(ours.work_ratio(requests, ours.plan(requests, list(range(len(requests))))))
    theirs, mine = harness._loglikelihood_tokens(requests), ours._loglikelihood_tokens(requests)
    assert len(mine) == len(theirs) == len(requests) > 7 * DOCUMENTS
    assert [greedy for _, greedy in mine] == [greedy for _, greedy in theirs]
    assert [greedy for _, greedy in mine[-len(questions) :]] == [True] * len(questions)
    for (ll_mine, _), (ll_theirs, _) in zip(mine, theirs, strict=True):
        assert ll_mine == pytest.approx(ll_theirs, rel=1e-5, abs=1e-4)
    # Both paths were taken: ours, and the harness's for requests longer than the model reads (boolq's passages
    # exceed stories260K's 512 tokens).
    fits = [len(context) + len(continuation) <= ours.max_length + 1 for _, context, continuation in requests]
    assert any(fits) and not all(fits)


def tokens_read_by_each(model, tokenizer, requests: list[Instance]) -> dict[str, int]:
    """The tokens the harness's scorer and ours give the model for `requests`."""
    tokens_read: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: tokens_read.append((args[0] if args else kwargs["input_ids"]).numel()),
        with_kwargs=True,
    )
    read = {}
    try:
        for name, scorer in (("harness", HFLM), ("ours", SharedContextLM)):
            tokens_read.clear()
            scorer(pretrained=model, tokenizer=tokenizer, batch_size=4).loglikelihood(requests)
            read[name] = sum(tokens_read)
    finally:
        hook.remove()
    return read


def test_each_context_is_read_once(requests_by_task, stories_dense_and_pruned):
    """hellaswag: four endings after one context. The harness reads the context four times, ours once."""
    models, tokenizer = stories_dense_and_pruned
    requests = requests_by_task["hellaswag"]
    read = tokens_read_by_each(models["dense"], tokenizer, requests)
    assert len({request.args[0] for request in requests}) == DOCUMENTS and len(requests) == 4 * DOCUMENTS
    assert 0 < read["ours"] < 0.7 * read["harness"]


def test_the_harness_reads_what_sharing_would_not_speed_up(requests_by_task, stories_dense_and_pruned):
    """One ending per hellaswag document: no context to share, and the shared plan's smaller batches would cost
    more than the logits it skips save. The harness reads them, token for token as it would alone."""
    models, tokenizer = stories_dense_and_pruned
    first_endings = [request for request in requests_by_task["hellaswag"] if request.idx == 0]
    assert len(first_endings) == DOCUMENTS
    read = tokens_read_by_each(models["dense"], tokenizer, first_endings)
    assert read["ours"] == read["harness"] > 0


def test_the_work_estimate_is_the_tokens_read_and_the_logits_computed(requests_by_task, stories_dense_and_pruned):
    """boolq: " yes" and " no" after each passage. The shared plan's estimate is the tokens the model is given plus
    the head's share of a token for each logit computed: once per passage (its last position predicts both choices'
    first token), not once per choice, and once per later continuation token."""
    models, tokenizer = stories_dense_and_pruned
    ours = SharedContextLM(pretrained=models["dense"], tokenizer=tokenizer, batch_size=4)
    fitting = [
        request
        for request in requests_by_task["boolq"]
        if sum(map(len, ours._encode_pair(*request.args))) <= ours.max_length + 1
    ]
    encoded = [(request.args, *ours._encode_pair(*request.args)) for request in fitting]
    plan = ours.plan(encoded, list(range(len(encoded))))
    assert shares_contexts(ours.work_ratio(encoded, plan))
    read = tokens_read_by_each(models["dense"], tokenizer, fitting)["ours"]
    passages = {tuple(context) for _, context, _ in encoded}
    assert len(fitting) == 2 * len(passages) >= 6
    later_tokens = read - sum(map(len, passages))  # the continuations' after their first: a logit each
    assert later_tokens == sum(len(continuation) - 1 for _, _, continuation in encoded)
    expected = read + ours._head_share() * (len(passages) + later_tokens)
    assert ours._work_shared(encoded, plan) == pytest.approx(expected)


@pytest.mark.parametrize(
    "task, path",
    [("hellaswag", "contexts shared"), ("hellaswag first endings", "the harness's"), ("boolq", "both")],
)
def test_progress_reaches_one_after_each_batch_on_every_path(requests_by_task, stories_dense_and_pruned, task, path):
    """The fraction of the reads done, after each batch the model reads: shared contexts (hellaswag), the harness's
    batches (one ending per document), or both (boolq's passages over stories260K's 512 tokens go to the harness)."""
    models, tokenizer = stories_dense_and_pruned
    requests = requests_by_task[task.split()[0]]
    if task.endswith("first endings"):
        requests = [request for request in requests if request.idx == 0]
    fractions: list[float] = []
    calls: list[str] = []
    scorer = SharedContextLM(
        pretrained=models["dense"], tokenizer=tokenizer, batch_size=4, on_progress=fractions.append
    )
    harness_call = scorer._model_call
    scorer._model_call = lambda *arguments, **keywords: calls.append("harness") or harness_call(*arguments, **keywords)
    scorer.loglikelihood(requests)
    harness_batches = {"contexts shared": 0, "the harness's": len(fractions)}.get(path)
    if harness_batches is None:
        assert 0 < len(calls) < len(fractions)
    else:
        assert len(calls) == harness_batches
    assert len(fractions) > 2 and fractions == sorted(fractions)
    assert 0 < fractions[0] < 0.5 and fractions[-1] == pytest.approx(1.0)
