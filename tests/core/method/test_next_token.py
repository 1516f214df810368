"""The next-token loss from hidden states in chunks (#37): the logits are the model's own forward's, in each family
whose head does more than a product (Granite's logits scaling, Gemma 2's final soft-capping), and the losses and
their gradient with respect to the hidden states are those of the full logits, whatever the chunk."""

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GraniteConfig, LlamaConfig, PretrainedConfig

from casp_core.method import next_token
from casp_core.method.next_token import final_hidden_states, head_logits, token_losses
from tests.core.families.helpers import COMMON, VOCAB
from tests.core.families.test_gemma import GEMMA
from tests.core.families.test_granite import MULTIPLIERS

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**COMMON),
    "granite": lambda: GraniteConfig(**COMMON, **MULTIPLIERS),
    "gemma2": lambda: Gemma2Config(**GEMMA, final_logit_softcapping=5.0),
}


@pytest.mark.parametrize("family", CONFIGS)
def test_chunked_losses_are_those_of_the_model_s_own_logits(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits.float()
        hidden = final_hidden_states(model, tokens)
        assert torch.equal(head_logits(model, hidden), logits)

    # 7 tokens a chunk: chunks across windows, the last one short.
    monkeypatch.setattr(next_token, "LOGITS_CHUNK_BYTES", 7 * 4 * VOCAB)
    assert next_token.tokens_per_chunk(VOCAB) == 7
    hidden = hidden[:, :-1].detach().requires_grad_(True)
    chunked = token_losses(model, hidden, tokens[:, 1:])
    (chunked_gradient,) = torch.autograd.grad(chunked.sum(), hidden)
    full = torch.nn.functional.cross_entropy(
        head_logits(model, hidden).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(3, 19)
    (full_gradient,) = torch.autograd.grad(full.sum(), hidden)
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_gradient, full_gradient, rtol=1e-5, atol=1e-9)
