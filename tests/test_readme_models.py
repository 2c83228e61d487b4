"""README's list of shipped model configs is the package's."""

from __future__ import annotations

import re
from pathlib import Path

from servetune.planner.modelinfo import known_models

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_names_every_shipped_model_and_no_other() -> None:
    text = README.read_text()
    line = text[text.index("Shipped configs:"):text.index("any other `config.json`")]
    named = set(re.findall(r"`([a-z0-9][a-z0-9.\-]+)`", line))
    named |= {n + "-fp8" for n in named if f"`{n}` (and `-fp8`)" in line}
    shipped = set(known_models()) - {"servetune-test-850m"}  # the test shape, not a user's model
    assert named == shipped
