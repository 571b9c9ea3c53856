"""The README's first screen is what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_starts_with_exactly_two_commands():
    commands = readme_commands()
    # issue 34: the first block makes and activates a virtual environment
    assert commands[:2] == ["python3 -m venv .venv && . .venv/bin/activate && pip install -e . && expertsim demo",
                            'pip install -e ".[test]" && python -m pytest -q']
    first_screen = (ROOT / "README.md").read_text().splitlines()[:24]
    assert sum(line.startswith(("pip install", "python3 -m venv")) for line in first_screen) == 2


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
