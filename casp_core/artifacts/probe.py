"""What a user's process computes with a checkpoint, measured in a process of its own:
`python -m casp_core.artifacts.probe CHECKPOINT OUT.safetensors`.

The model comes from `AutoModelForCausalLM.from_pretrained(CHECKPOINT, trust_remote_code=True)`, so a pruned
checkpoint runs the modeling file it carries (auto_map), not casp_core's: this module imports nothing of casp_core
(casp_core.families would register casp_core's own config class), and a fresh process holds no copy of an
earlier modeling file under the same module name. Written to OUT: `logits`, the uncached forward's on `prompt`,
and `cached` / `uncached`, greedy generation from it with the cache and without.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

PROMPT_SHAPE = (2, 8)  # two prompts of eight ids, so a batch's cache is exercised too
PROMPT_SEED = 0
NEW_TOKENS = 24


@torch.no_grad()
def probe(checkpoint: Path) -> dict[str, torch.Tensor]:
    # float32 whatever the checkpoint's dtype: two implementations' half-precision roundings would neither hide a
    # wrong head mapping nor agree bit for bit on a right one.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randint(model.config.vocab_size, PROMPT_SHAPE, generator=generator)
    # Every sequence runs the full length (no stop at EOS), so that the two generations compare token for token.
    greedy = {
        "attention_mask": torch.ones_like(prompt),
        "do_sample": False,
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
    }
    return {
        "prompt": prompt,
        "logits": model(prompt, use_cache=False).logits.contiguous(),
        "cached": model.generate(prompt, use_cache=True, **greedy),
        "uncached": model.generate(prompt, use_cache=False, **greedy),
    }


if __name__ == "__main__":
    checkpoint, out = sys.argv[1:]
    save_file(probe(Path(checkpoint)), out)
