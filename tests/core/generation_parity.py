"""Greedy generation of written checkpoints, run as a script in a fresh process that never imports casp_core.

    python generation_parity.py REFERENCE:CHECKPOINT [REFERENCE:CHECKPOINT ...]

A pruned checkpoint loads the way a user loads it (`from_pretrained(path, trust_remote_code=True)`), so its own copy
of the modeling file runs under the installed transformers. For each checkpoint and attention implementation
(eager, sdpa) it prints one JSON object per line with the tokens that tests/core/artifacts/test_generation.py compares:
greedy generation with the cache and without it and the reference's (the masked dense model's), in float64; the
shapes the cache holds per layer; and, in float32, left-padded prompts generated as one batch and each alone.
transformers' masks add float64's lowest value to the scores, which overflows to -inf on the padded rows and
makes them NaN in float64, for its own classes too; float32 keeps them finite.
"""

import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

PROMPTS = ([5, 17, 301, 42, 7, 99], [11, 250, 3, 480, 77, 6, 19, 333, 2], [400, 12, 58])
NEW_TOKENS = 10  # the prompt and the generation together run past the test models' sliding window of 8
PAD = 0
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def load(path: str, attention: str) -> transformers.PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation=attention)
    model.generation_config.eos_token_id = None  # every generation runs its full length, so all can be compared
    return model.eval()


def generate(model: transformers.PreTrainedModel, prompt: list[int], *, use_cache: bool) -> list[int]:
    tokens = torch.tensor([prompt])
    out = model.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=use_cache, pad_token_id=PAD)
    return out[0, len(prompt) :].tolist()


def generate_batch(model: transformers.PreTrainedModel, prompts: tuple[list[int], ...]) -> list[list[int]]:
    """The prompts left-padded to one length, as a server batches them."""
    width = max(len(prompt) for prompt in prompts)
    tokens = torch.tensor([[PAD] * (width - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    return out[:, width:].tolist()


@torch.no_grad()
def cached_shapes(model: transformers.PreTrainedModel, prompt: list[int]) -> list[list[int]]:
    """(batch, heads, tokens, head_dim) of each layer's cached keys after one forward pass (None: nothing cached)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.24
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    return [None if layer_keys is None else list(layer_keys.shape) for layer_keys in keys]


def compare(path: str, attention: str, reference: list[list[int]]) -> dict:
    model = load(path, attention).double()
    record = {
        "checkpoint": path,
        "attention": attention,
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "reference": reference,
        "cached": [generate(model, prompt, use_cache=True) for prompt in PROMPTS],
        # Without the cache each step runs the whole sequence again: the longest prompt is enough.
        "uncached": generate(model, PROMPTS[1], use_cache=False),
        "cache_shapes": cached_shapes(model, PROMPTS[0]),
    }
    model.float()
    record["alone_float32"] = [generate(model, prompt, use_cache=True) for prompt in PROMPTS]
    record["batched_float32"] = generate_batch(model, PROMPTS)
    record["casp_core_imported"] = "casp_core" in sys.modules
    return record


if __name__ == "__main__":
    torch.set_num_threads(1)  # the test runs one process per transformers version side by side
    for pair in sys.argv[1:]:
        reference_path, path = pair.split(":")
        # The masked dense model computes the same in either implementation (float64): generated once.
        reference = load(reference_path, "sdpa").double()
        expected = [generate(reference, prompt, use_cache=True) for prompt in PROMPTS]
        for attention in ATTENTION_IMPLEMENTATIONS:
            print(json.dumps(compare(path, attention, expected)), flush=True)
