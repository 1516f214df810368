"""Every snippet of the model card runs as written, as a user of the uploaded checkpoint runs it: the Python in a
fresh process with no stdin, where casp_core cannot be imported, only the model name (the card's placeholder for the
folder or the repository) replaced by the checkpoint's path; the shell lines in a folder where that name is the
checkpoint. For both shapes: per layer (remote code) and uniform (plain llama), and with a GGUF written beside."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from casp_core.job.run import run_job
from tests.conftest import REPO, STORIES, tiny_config
from tests.core.fresh_process import run_python

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
# The commands of the card's shell snippets, as this machine has them: `casp` is this tree's; `llama-cli` (not
# installed here) is llama.cpp through llama-cpp-python, taking the flags the card gives it, greedy.
CASP_COMMAND = f"""#!{sys.executable}
import sys
sys.path.insert(0, {str(REPO)!r})
from casp_cli.main import main
sys.exit(main())
"""
LLAMA_CLI_COMMAND = f"""#!{sys.executable}
import argparse
import llama_cpp
parser = argparse.ArgumentParser()
parser.add_argument("-m", required=True)
parser.add_argument("-p", required=True)
parser.add_argument("-n", type=int, required=True)
args = parser.parse_args()
llm = llama_cpp.Llama(model_path=args.m, n_ctx=256, verbose=False)
print(args.p + llm(args.p, max_tokens=args.n, temperature=0.0)["choices"][0]["text"])
"""
SHAPES = {"per_layer": {"shape": "per_layer"}, "uniform": {"shape": "uniform"}, "gguf": {"export": ["gguf"]}}
# What transformers prints before its stdin question about remote code (with no stdin it then goes on quietly).
REMOTE_CODE_QUESTION = "Do you wish to run the custom code?"


# make test runs the default shape's card; the uniform shape's and the GGUF's (about 25 s) are `make test-slow`'s.
SLOW_SHAPES = ("uniform", "gguf")


@pytest.fixture(
    scope="module",
    params=[pytest.param(shape, marks=pytest.mark.slow) if shape in SLOW_SHAPES else shape for shape in SHAPES],
)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "checkpoint"
    run_job(str(STORIES), tiny_config(0.3, **SHAPES[request.param]), out)
    return out


def test_python_snippets_run_as_written_without_casp_core(checkpoint: Path, tmp_path: Path) -> None:
    card = (checkpoint / "README.md").read_text(encoding="utf-8")
    name = ModelCard(card).data.model_name
    snippets = PYTHON_BLOCK.findall(card)
    assert len(snippets) == 1 and f'"{name}"' in snippets[0]
    unimportable = run_python("import casp_core", cwd=tmp_path)
    assert unimportable.returncode != 0 and "No module named 'casp_core'" in unimportable.stderr

    completed = run_python(snippets[0].replace(f'"{name}"', json.dumps(str(checkpoint))), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert REMOTE_CODE_QUESTION not in completed.stdout + completed.stderr
    # The snippet prints the prompt and its greedy continuation: 32 tokens more than the prompt's own.
    text = completed.stdout.strip().splitlines()[-1]
    assert text.startswith("<s> Once upon a time") and len(text) > len("<s> Once upon a time") + 32


def test_shell_snippets_run_as_written(checkpoint: Path, tmp_path: Path) -> None:
    card = (checkpoint / "README.md").read_text(encoding="utf-8")
    name = ModelCard(card).data.model_name
    llama_cpp_block, *others = BASH_BLOCK.findall(card)
    # vLLM is not installed here (it needs a GPU): its one line is the only snippet not run.
    uniform = json.loads((checkpoint / "config.json").read_text())["model_type"] == "llama"
    assert others == ([f"vllm serve {name}\n"] if uniform else [])
    commands = tmp_path / "bin"
    commands.mkdir()
    for command, source in {"casp": CASP_COMMAND, "llama-cli": LLAMA_CLI_COMMAND}.items():
        (commands / command).write_text(source)
        (commands / command).chmod(0o755)
    # `name` is this folder: the card's commands run beside it, or in it where a GGUF was written into it.
    gguf = sorted(path.name for path in checkpoint.glob("*.gguf"))
    if gguf:
        folder = checkpoint
        assert llama_cpp_block == f'llama-cli -m {gguf[0]} -p "Once upon a time" -n 64\n'
    else:
        folder = tmp_path / "work"
        folder.mkdir()
        (folder / name).symlink_to(checkpoint)
        assert llama_cpp_block.startswith(f"casp export {name} --format gguf --out {name}.gguf")
    env = {"PATH": f"{commands}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["HOME"] = os.environ.get("HOME", str(tmp_path))
    completed = subprocess.run(
        ["bash", "-e", "-c", llama_cpp_block],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert REMOTE_CODE_QUESTION not in completed.stdout + completed.stderr
    # After `casp export`'s summary, the prompt and its greedy continuation (64 tokens, over several lines).
    if not gguf:
        summary, completed.stdout = completed.stdout.split("\n", 1)
        assert json.loads(summary)["path"] == f"{name}.gguf"
    assert completed.stdout.startswith("Once upon a time"), completed.stdout
    assert len(completed.stdout.strip()) > len("Once upon a time") + 64, completed.stdout
