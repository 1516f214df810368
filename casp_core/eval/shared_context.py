"""The harness's log-likelihoods with each context read once.

lm-evaluation-harness's `HFLM` scores a (context, continuation) request by one forward over context +
continuation that computes the vocabulary's logits at every position. A multiple-choice task's choices share
their context (hellaswag's four endings follow one passage, boolq's " yes" and " no" one passage and question),
and only the positions that predict a continuation token are read. `SharedContextLM` reads each context once,
keeps its KV cache, and reads the choices' continuations from it (batched by length), computing logits only where
they are read: the same log-likelihoods and greedy flags (up to float rounding: the attention sums in another
order), for less work: bench/results/zero_shot_scorer.md says how much.

Everything else (requests, prompts, metrics, truncation of over-long requests) is the harness's: this module
overrides `_loglikelihood_tokens`, and hands it back the requests it does not serve: over-long ones, every request
of a sequence-to-sequence model, and all of them where sharing would save under a fifth of the work. Either way,
`on_progress` hears the fraction of the reads done after each batch (the harness's counted in `_model_call`).
"""

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import Cache

Request = tuple[tuple[str, str] | None, list[int], list[int]]
Answer = tuple[float, bool]
# Batches of contexts (token ids) with the indices of the requests that continue each.
Plan = list[list[tuple[tuple[int, ...], list[int]]]]
AUTO_BATCH_SIZE = 16  # evaluate_zero_shot's default
# Contexts are shared where that saves a fifth of the work or more: its batches are smaller and more numerous, and
# cost more a token. bench/zero_shot_scorer.py at a8c9333, which shared every task's: on SmolLM2's first 200
# documents winogrande, at 0.83 of the harness's work, took 1.12 times its time; piqa, at 1.32, 1.46; boolq, at
# 0.62, 0.73.
SHARED_WORTH_IT = 0.8


def shares_contexts(work_ratio: float) -> bool:
    """Whether a plan estimated at `work_ratio` of the harness's work is worth its contexts shared."""
    return work_ratio <= SHARED_WORTH_IT


def harness_inputs(requests: list[Request]) -> set[tuple[int, ...]]:
    """What the harness's `HFLM` gives the model for `requests`: each context + continuation but the last token,
    once for requests that differ only in a one-token continuation (its `logits_cache`)."""
    return {tuple(context + continuation[:-1]) for _, context, continuation in requests}


class SharedContextLM(HFLM):
    """`HFLM` whose log-likelihood requests sharing a context share its forward."""

    def __init__(self, *args: Any, on_progress: Callable[[float], None] | None = None, **kwargs: Any) -> None:
        """`on_progress`, when given, is called after each batch the model reads with the fraction of the reads
        done (a cancelled job's raises there, between batches)."""
        super().__init__(*args, **kwargs)
        self.on_progress = on_progress
        self._reads_done = self._reads_planned = 0

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[Answer]:
        # Where `on_progress` hears the scoring, no bar of the harness's (tokenizing, scoring) runs beside it.
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.on_progress is not None)

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[Answer]:
        try:
            return self._score_requests(requests, disable_tqdm, override_bs)
        finally:
            self._reads_planned = 0  # a forward outside a scoring reports nothing

    def _score_requests(self, requests: list[Request], disable_tqdm: bool, override_bs: int | None) -> list[Answer]:
        answers: dict[int, Answer] = {}
        handed_back = [
            index
            for index, (_, context, continuation) in enumerate(requests)
            if self.backend != "causal" or len(context) + len(continuation) > self.max_length + 1
        ]
        harness_reads = set(handed_back)
        served = [index for index in range(len(requests)) if index not in harness_reads]
        batches = self.plan(requests, served)
        self._reads_done = 0
        if not shares_contexts(self.work_ratio(requests, batches)):
            # Choices whose contexts are short beside them (piqa) or differ (winogrande) gain little or nothing from
            # a shared context, and its smaller, more numerous batches cost more a token: the harness is faster.
            self._reads_planned = len(harness_inputs(requests))
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # A read: one of the harness's inputs, or one request of ours.
        self._reads_planned = len(harness_inputs([requests[index] for index in handed_back])) + len(served)
        if handed_back:
            harness_answers = super()._loglikelihood_tokens(
                [requests[index] for index in handed_back], disable_tqdm=disable_tqdm, override_bs=override_bs
            )
            answers.update(zip(handed_back, harness_answers, strict=True))
        progress = tqdm(
            total=len(requests) - len(handed_back),
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood requests (contexts shared)",
        )
        for batch in batches:
            scored = self._score_batch(
                [list(context) for context, _ in batch],
                [[requests[index][2] for index in indices] for _, indices in batch],
            )
            for (_, indices), answers_of_context in zip(batch, scored, strict=True):
                for index, answer in zip(indices, answers_of_context, strict=True):
                    answers[index] = answer
                    request_string = requests[index][0]
                    if request_string is not None:  # loglikelihood_rolling's windows cache per document instead
                        self.cache_hook.add_partial("loglikelihood", request_string, answer)
                progress.update(len(indices))
                self._advance(len(indices))
        progress.close()
        return [answers[index] for index in range(len(requests))]

    def _model_call(
        self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The harness's forward over one of its batches; the batch's rows count as reads done."""
        logits = super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        self._advance(len(inps))
        return logits

    def _advance(self, reads: int) -> None:
        if not self._reads_planned:
            return
        self._reads_done += reads
        if self.on_progress is not None:
            self.on_progress(min(1.0, self._reads_done / self._reads_planned))

    def plan(self, requests: list[Request], indices: list[int]) -> Plan:
        """The batches that score `requests[indices]` with their contexts shared (`_batches`)."""
        choices_of: dict[tuple[int, ...], list[int]] = {}
        for index in indices:
            choices_of.setdefault(tuple(requests[index][1]), []).append(index)
        return self._batches(choices_of)

    def work_ratio(self, requests: list[Request], batches: Plan) -> float:
        """The estimated work of `batches` (`plan`'s for some of `requests`) beside the harness's for the same
        requests."""
        served = [requests[index] for batch in batches for _, indices in batch for index in indices]
        return self._work_shared(requests, batches) / self._work_harness(served)

    def _work_shared(self, requests: list[Request], batches: Plan) -> float:
        """The model's work for `batches` of `requests`, in tokens through the body (padding included) plus the
        head's share of a token for each position whose logits are computed: each context's last (once however
        many choices follow it) and the continuations' later ones."""
        contexts_read = context_tokens = continuation_tokens = 0
        for batch in batches:
            contexts_read += len(batch)
            context_tokens += len(batch[0][0]) * len(batch)
            rows = [requests[index][2] for _, indices in batch for index in indices]
            continuation_tokens += sum(
                len(chunk) * (len(rows[chunk[0]]) - 1) for chunk in self._continuation_batches(rows)
            )
        return context_tokens + continuation_tokens + self._head_share() * (contexts_read + continuation_tokens)

    def _work_harness(self, requests: list[Request]) -> float:
        """The same for the harness's `HFLM`, which computes logits at every position of its inputs
        (`harness_inputs`), sorted by length, `batch_size` a batch, each padded to its first."""
        lengths = sorted((len(tokens) for tokens in harness_inputs(requests)), reverse=True)
        per_batch = self._per_batch()
        batches = [lengths[start : start + per_batch] for start in range(0, len(lengths), per_batch)]
        return (1 + self._head_share()) * sum(len(batch) * batch[0] for batch in batches)

    def _head_share(self) -> float:
        """A position's logits beside a token through the rest of the model, in multiply-adds (MoE models' experts
        all counted: an underestimate there)."""
        embeddings = {id(self.model.get_input_embeddings().weight), id(self.model.get_output_embeddings().weight)}
        rest = sum(parameter.numel() for parameter in self.model.parameters() if id(parameter) not in embeddings)
        return self.model.get_output_embeddings().weight.numel() / rest

    def _per_batch(self) -> int:
        """The batch size asked for; with "auto" (the harness's search for the largest that fits), its default."""
        return self.batch_size if isinstance(self.batch_size, int) else AUTO_BATCH_SIZE

    def _batches(self, choices_of: dict[tuple[int, ...], list[int]]) -> Plan:
        """Contexts of one length, at most `batch_size` of them a batch, with at most `batch_size` choices each
        (a context with more is read again for each further `batch_size`). One length needs no padding, so no
        attention mask: every context is read exactly as the harness reads it."""
        per_batch = self._per_batch()
        of_length: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}
        for context, indices in choices_of.items():
            for start in range(0, len(indices), per_batch):
                of_length.setdefault(len(context), []).append((context, indices[start : start + per_batch]))
        return [
            same_length[start : start + per_batch]
            for _, same_length in sorted(of_length.items(), reverse=True)
            for start in range(0, len(same_length), per_batch)
        ]

    def _score_batch(self, contexts: list[list[int]], continuations: list[list[list[int]]]) -> list[list[Answer]]:
        """For each context (all of one length), each of its continuations' summed log-probability after it, and
        whether greedy decoding yields that continuation."""
        owner = [context for context, of_context in enumerate(continuations) for _ in of_context]
        rows = [continuation for of_context in continuations for continuation in of_context]
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            read = self.model(torch.tensor(contexts, device=self.device), use_cache=True, logits_to_keep=1)
            # A context's last position predicts each of its continuations' first token; the rest follow.
            first = read.logits[:, -1]
            later = self._later_logits(read.cache, owner, rows)
        answers: list[list[Answer]] = [[] for _ in contexts]
        for row, (context, continuation) in enumerate(zip(owner, rows, strict=True)):
            logits = first[context : context + 1]
            if row in later:
                logits = torch.cat([logits, later[row]])
            log_probabilities = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            target = torch.tensor(continuation, device=log_probabilities.device)
            chosen = log_probabilities.gather(1, target[:, None])
            greedy = bool((log_probabilities.argmax(dim=-1) == target).all())
            answers[context].append((float(chosen.sum()), greedy))
        return answers

    def _later_logits(self, cache: Cache, owner: list[int], rows: list[list[int]]) -> dict[int, torch.Tensor]:
        """Each continuation's logits after its first token, by its row (none for a one-token continuation), read
        from its context's entry in `cache`, each batch from its own copy of the cache (a few milliseconds)."""
        batches = self._continuation_batches(rows)
        later: dict[int, torch.Tensor] = {}
        for batch in batches:
            batch_cache = copy.deepcopy(cache) if len(batches) > 1 else cache
            batch_cache.batch_select_indices(torch.tensor([owner[row] for row in batch], device=self.device))
            width = len(rows[batch[0]]) - 1
            # Right padding: no position before a pad attends to it, so it changes no logit that is read.
            inputs = [rows[row][:-1] + [rows[row][-1]] * (width + 1 - len(rows[row])) for row in batch]
            logits = self.model(torch.tensor(inputs, device=self.device), cache=batch_cache, use_cache=True).logits
            for position, row in enumerate(batch):
                later[row] = logits[position, : len(rows[row]) - 1]
        return later

    def _continuation_batches(self, rows: list[list[int]]) -> list[list[int]]:
        """The rows of continuations longer than one token, as the harness batches its requests: sorted by length,
        `batch_size` a batch, so that little is padding."""
        longer = sorted((row for row, tokens in enumerate(rows) if len(tokens) > 1), key=lambda row: -len(rows[row]))
        per_batch = self._per_batch()
        return [longer[start : start + per_batch] for start in range(0, len(longer), per_batch)]
