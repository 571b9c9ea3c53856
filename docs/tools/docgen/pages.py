"""What the pages hold that code must keep true: quoted numbers and generated regions.

A quoted number is written where it is read, followed by a comment naming where it comes from:

    decode runs at 30.6<!--=ds4-504.per_class_decode_tok_s--> tok/s

The comment is invisible in the rendered page and the number stays readable in the markdown source; the
check compares the text before the comment with the exhibit's number (docs/figures/ds4-504.json).

A generated region is a block between two comments, rewritten from code (a table, a CLI reference):

    <!-- BEGIN generated cli -->
    ...
    <!-- END generated cli -->
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"

# The quoted text is the token right before the comment: no spaces, no markdown or bracket characters.
NUMBER = re.compile(r"(?P<value>[^\s<>()\[\]|*`\"']+)<!--=(?P<key>[\w-]+\.\w+)-->")
REGION = re.compile(r"<!-- BEGIN generated (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- END generated (?P=name) -->",
                    re.S)


def pages() -> list[Path]:
    """Every markdown page of the site (the tools' folder is not part of it)."""
    return sorted(p for p in DOCS.rglob("*.md") if "tools" not in p.relative_to(DOCS).parts)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def load_numbers() -> dict[str, str]:
    """Every exhibit's numbers as "exhibit.key" -> text, from the committed JSON files."""
    numbers = {}
    for path in sorted(FIGURES.glob("*.json")):
        for key, value in json.loads(path.read_text())["numbers"].items():
            numbers[f"{path.stem}.{key}"] = value
    return numbers


def check_numbers(update: bool = False) -> list[str]:
    """Problems with quoted numbers: an unknown key, a number that differs from its exhibit, or an
    exhibit number no page quotes. With update, differing numbers are rewritten in the pages."""
    numbers = load_numbers()
    problems, used = [], set()
    for page in pages():
        text = page.read_text()

        def fix(match: re.Match) -> str:
            key, value = match["key"], match["value"]
            used.add(key)
            if key not in numbers:
                problems.append(f"{rel(page)}: quotes unknown number {key}")
            elif value != numbers[key]:
                if not update:
                    problems.append(f"{rel(page)}: {key} is {numbers[key]} now, the page says {value}")
                return numbers[key] + match.group(0)[len(value):]
            return match.group(0)

        new = NUMBER.sub(fix, text)
        unreadable = text.count("<!--=") - len(NUMBER.findall(text))
        if unreadable:
            problems.append(f"{rel(page)}: {unreadable} number marker(s) with no number right before them")
        if update and new != text:
            page.write_text(new)
    problems += [f"docs/figures: number {key} is quoted by no page" for key in sorted(set(numbers) - used)]
    return problems


def check_regions(render, update: bool = False) -> list[str]:
    """Problems with generated regions (render(name) -> markdown); with update, regions are rewritten."""
    problems = []
    for page in pages():
        text = page.read_text()

        def fix(match: re.Match) -> str:
            name = match["name"]
            body = render(name)
            if body is None:
                problems.append(f"{rel(page)}: unknown generated region {name}")
                return match.group(0)
            if body != match["body"] and not update:
                problems.append(f"{rel(page)}: generated region {name} is stale")
            return f"<!-- BEGIN generated {name} -->\n{body}<!-- END generated {name} -->"

        new = REGION.sub(fix, text)
        if update and new != text:
            page.write_text(new)
    return problems


def figure_links() -> dict[str, set[str]]:
    """Figure file names (STEM.svg) each page embeds."""
    found = {}
    for page in pages():
        found[rel(page)] = set(re.findall(r"figures/([\w-]+\.svg)\)", page.read_text()))
    return found
