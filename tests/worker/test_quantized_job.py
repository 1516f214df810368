"""A job with `quantization` through the API, run by hand in the embedded mode as a worker runs it: its checkpoint
is compressed-tensors, loads without casp_core, and the result carries the scheme and both perplexities; a scheme
the model's widths cannot take is a 422 naming `quantization` and the closest valid choice."""

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from service.storage import make_storage
from tests.core.fresh_process import run_python
from tests.service_fixtures import TINY_JOB, embedded_settings
from worker.runner import execute

pytestmark = pytest.mark.service

JOB = {
    **TINY_JOB,
    "solver": "diagonal",
    "device": "cpu",
    "evaluation": {"perplexity": ["wikitext2"], "seq_len": 64, "limit": 4},
    "quantization": "w8a8_int8",
    "shape": "uniform",
}
PLAIN_LOAD = """
import importlib.util, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
assert importlib.util.find_spec("casp_core") is None
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
inputs = tokenizer("Once upon a time", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
new = len(out[0]) - inputs.input_ids.shape[1]
print(type(model).__name__, type(model.model.layers[0].mlp.down_proj.quantization_scheme).__name__, new > 0)
"""


@pytest.mark.slow
def test_a_w8a8_uniform_job_publishes_a_compressed_tensors_checkpoint(tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path)
    folder = tmp_path / "downloaded"
    folder.mkdir()
    with TestClient(create_app(settings)) as client:
        refused = client.post("/v1/jobs", json={**JOB, "quantization": "w4a16"})
        job_id = client.post("/v1/jobs", json=JOB).json()["id"]
        assert execute(job_id, settings, make_storage(settings), worker_id="by-hand") == "succeeded"
        job = client.get(f"/v1/jobs/{job_id}").json()
        for artifact in client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]:
            (folder / artifact["name"]).parent.mkdir(parents=True, exist_ok=True)
            (folder / artifact["name"]).write_bytes(client.get(artifact["url"]).content)

    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "quantization" and "head_dim is 8" in error["message"], error
    assert error["message"].endswith("use w8a8_int8 (one scale per channel, any width)")
    assert job["settings"]["quantization"] == "w8a8_int8"
    assert job["result"]["quantization"]["scheme"] == "w8a8_int8"
    entry = job["result"]["perplexity"]["wikitext2"]
    assert entry["quantized"] != entry["pruned"] and abs(entry["quantized"] / entry["pruned"] - 1) < 0.05, entry
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    loaded = run_python(PLAIN_LOAD, str(folder), cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["LlamaForCausalLM", "QuantizationScheme", "True"]
