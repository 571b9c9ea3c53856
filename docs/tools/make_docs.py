"""Regenerate what the docs quote from the code, or check that it is current.

    python docs/tools/make_docs.py                 # exhibits, quoted numbers, generated regions, snippets
    python docs/tools/make_docs.py --only lending  # one exhibit (and everything cheap)
    python docs/tools/make_docs.py --check         # change nothing; list what is stale, exit 1 if any

Order matters: exhibits first (docs/figures/NAME.json and STEM.svg), then the numbers and the regions
that read those files, then the snippets' golden files and shown outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docgen import exhibits, pages, reference, snippets  # noqa: E402 - after the path is set


def exhibit_problems(name: str, update: bool) -> list[str]:
    """Compute one exhibit; problems where its JSON or figures on disk differ (rewritten with update)."""
    result = exhibits.EXHIBITS[name]()
    files = {pages.FIGURES / f"{name}.json": json.dumps(result.record(), indent=1, sort_keys=True) + "\n"}
    files.update({pages.FIGURES / f"{stem}.svg": text for stem, text in result.figures.items()})
    problems = []
    for path, text in files.items():
        if path.exists() and path.read_text() == text:
            continue
        if update:
            path.write_text(text)
        else:
            problems.append(f"{pages.rel(path)} is stale (exhibit {name})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; report what is stale")
    parser.add_argument("--only", nargs="*", choices=sorted(exhibits.EXHIBITS), help="exhibits to compute")
    parser.add_argument("--no-snippets", action="store_true", help="skip running the snippets")
    args = parser.parse_args()
    update = not args.check
    problems: list[str] = []
    for name in args.only or sorted(exhibits.EXHIBITS):
        start = time.perf_counter()
        problems += exhibit_problems(name, update)
        print(f"exhibit {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    problems += pages.check_numbers(update)
    problems += pages.check_regions(reference.render, update)
    if not args.no_snippets:
        for page in snippets.runnable_pages():
            start = time.perf_counter()
            problems += snippets.check_page(page, update)
            print(f"snippets {pages.rel(page)}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        problems += snippets.orphans(update)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
