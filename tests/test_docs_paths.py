"""The docs read the same on every clone: no command in them names one machine's absolute path (a checkout, a
home folder, a virtual environment), only paths relative to the repository or placeholders."""

import re

from tests.conftest import REPO

# /work/main/.venv/bin/python, /home/alice/casp, /Users/..., /root/...: where one machine keeps its checkout.
MACHINE_PATH = re.compile(r"(?<![\w$.}])/(?:work|home|root|Users)/[\w.-]+")


def test_no_doc_names_a_machine_s_absolute_path() -> None:
    docs = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [
        f"{path.relative_to(REPO)}:{number}: {match.group()}"
        for path in docs
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in MACHINE_PATH.finditer(line)
    ]
    assert found == []
