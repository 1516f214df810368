"""README's table of settings is casp_core.settings's settings, as casp_core.cli.setting_flags.settings_table() writes
them: names, flags, defaults, ranges and descriptions."""

import re

from casp_core.cli.setting_flags import settings_table
from tests.conftest import REPO

TABLE = re.compile(r"<!-- settings table:[^\n]*-->\n(.*?)\n<!-- end of settings table -->", re.DOTALL)


def test_the_readme_table_of_settings_is_the_config() -> None:
    found = TABLE.search((REPO / "README.md").read_text())
    assert found, "README.md has no table of settings between its markers"
    assert found.group(1) == settings_table(), (
        "README.md's table of settings differs from casp_core.settings; paste this in:\n" + settings_table()
    )
