"""Every shell and Python snippet of the docs runs, and its output is compared with a golden file.

A fenced block tagged `bash`, `sh`, `console`, `shell`, `python` or `py` is runnable unless the line
before its fence says why not:

    <!-- docs-test: skip needs a CUDA GPU -->

A runnable shell block holds `expertsim` commands only (one per line, `\\` continues a line, `#` starts a
comment); anything else (a `pip install`, a pipe) must be marked skip with its reason. Its commands must
succeed, unless the block shows an error on purpose and names the exit code: `<!-- docs-test: exit 2 -->`.
The commands run in this process through `sim.cli.main`, which is what the `expertsim` script calls, so a
page of snippets costs one numba warm-up rather than one per command; the console is 100 columns wide and
colourless.
Python blocks run with exec, in one namespace per page. Both run in a scratch folder where `scenarios/`
and `traces/` are links to the repository's, so `-o out/x` writes nothing into the checkout.

The golden file, tests/golden/docs/PAGE/NN.txt, holds the block's commands and their output; when a page
shows the output (a ```text block right after, marked `<!-- docs-test: output -->`), that block must
equal it too. Paths of the checkout and of the scratch folder are written as <repo> and <tmp>.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from docgen.pages import DOCS, ROOT, pages, rel

GOLDEN = ROOT / "tests" / "golden" / "docs"
LANGS = {"bash": "shell", "sh": "shell", "console": "shell", "shell": "shell", "python": "python", "py": "python"}
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- docs-test: (?P<what>skip|output|exit)(?P<why>[^>]*?)\s*-->\s*$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CONSOLE_WIDTH = 100


@dataclass
class Block:
    kind: str  # "shell", "python" or "output"
    code: str
    start: int  # offsets of the code inside the page text
    end: int
    skip: str | None = None
    exit_code: int = 0  # what its commands must end with; an error example says so: <!-- docs-test: exit 2 -->
    output: "Block | None" = None  # the page's copy of this block's output


def blocks(text: str) -> tuple[list[Block], list[str]]:
    """The page's runnable blocks (with the output blocks that follow them) and its problems."""
    found: list[Block] = []
    problems: list[str] = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        kind = LANGS.get(m["lang"])
        if mark and mark["what"] == "output":
            if not found or found[-1].output is not None:
                problems.append(f"an output block at offset {m.start()} follows no runnable block")
                continue
            found[-1].output = Block("output", m["code"], m.start("code"), m.end("code"))
            continue
        if kind is None:
            continue
        skip, exit_code = None, 0
        if mark and mark["what"] == "skip":
            skip = mark["why"].strip()
            if not skip:
                problems.append(f"a skipped block at offset {m.start()} gives no reason")
        if mark and mark["what"] == "exit":
            exit_code = int(mark["why"])
        found.append(Block(kind, m["code"], m.start("code"), m.end("code"), skip, exit_code))
    return found, problems


def shell_commands(code: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    commands, current = [], ""
    for line in code.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        commands.append(current + stripped)
        current = ""
    return commands


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`expertsim ARGV` in this process: (exit code, stdout, stderr)."""

    from sim import cli
    from sim.cli import tables

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, saved_width = sys.argv, tables.PIPED_WIDTH
    sys.argv = ["expertsim", *argv]
    # tables as a page can show them: the captured stdout is not a terminal, so the CLI prints at its piped
    # width; a page's is narrower: a wide table is turned or trimmed as at a 100-column terminal
    tables.PIPED_WIDTH = CONSOLE_WIDTH
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, tables.PIPED_WIDTH = saved_argv, saved_width
    return code, stdout.getvalue(), stderr.getvalue()


def normalise(text: str, workdir: Path) -> str:
    text = ANSI.sub("", text)
    for folder, name in ((workdir.resolve(), "<tmp>"), (workdir, "<tmp>"), (ROOT, "<repo>")):
        text = text.replace(str(folder), name)
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(lines) + "\n" if lines else ""


@dataclass
class Result:
    transcript: str  # what the golden file holds: the commands and their output
    shown: str  # what an output block on the page shows: the output alone


def run_block(block: Block, workdir: Path, namespace: dict) -> Result:
    if block.kind == "python":
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block.code, "<docs snippet>", "exec"), namespace)  # noqa: S102 - the docs' own code
        shown = normalise(stdout.getvalue(), workdir)
        return Result(f"# python\n{block.code}# output\n{shown}", shown)
    transcript, shown = [], []
    for command in shell_commands(block.code):
        argv = shlex.split(command)
        if not argv or argv[0] != "expertsim" or any(t in ("|", ">", "<", "&&", ";") for t in argv):
            raise ValueError(f"not an expertsim command: {command!r}; mark the block skip with a reason")
        code, out, err = run_cli(argv[1:])
        if code != block.exit_code:
            raise ValueError(f"{command!r} ended with exit code {code}, not {block.exit_code}: {err.strip()}")
        part = normalise(out, workdir) + (f"[exit {code}]\n" + normalise(err, workdir) if code else "")
        transcript.append(f"$ {command}\n{part}")
        shown.append(part)
    return Result("".join(transcript), "".join(shown))


def golden_path(page: Path, n: int) -> Path:
    return GOLDEN / page.relative_to(DOCS).with_suffix("") / f"{n:02d}.txt"


@contextlib.contextmanager
def scratch():
    """A scratch folder holding links to the repository's scenarios and traces, as the working folder."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="expertsim-docs-") as tmp:
        work = Path(tmp)
        for name in ("scenarios", "traces"):
            (work / name).symlink_to(ROOT / name, target_is_directory=True)
        os.chdir(work)
        try:
            yield work
        finally:
            os.chdir(cwd)


def runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b.skip is None for b in blocks(p.read_text())[0])]


def check_page(page: Path, update: bool = False) -> list[str]:
    """Run the page's snippets; problems where a golden file or a shown output differs. With update,
    golden files and the page's output blocks are rewritten instead."""
    text = page.read_text()
    found, problems = blocks(text)
    problems = [f"{rel(page)}: {p}" for p in problems]
    replacements = []
    namespace: dict = {"__name__": "__docs__"}
    with scratch() as work:
        runnable = [b for b in found if b.skip is None]
        for n, block in enumerate(runnable, 1):
            try:
                result = run_block(block, work, namespace)
            except Exception as exc:  # noqa: BLE001 - report which snippet failed and why
                problems.append(f"{rel(page)} snippet {n}: {type(exc).__name__}: {exc}")
                continue
            golden = golden_path(page, n)
            if update:
                golden.parent.mkdir(parents=True, exist_ok=True)
                golden.write_text(result.transcript)
            elif not golden.exists():
                problems.append(f"{rel(page)} snippet {n}: no golden file {rel(golden)}")
            elif golden.read_text() != result.transcript:
                problems.append(f"{rel(page)} snippet {n}: output differs from {rel(golden)}:\n"
                                + _diff(golden.read_text(), result.transcript))
            if block.output is not None and block.output.code != result.shown:
                if update:
                    replacements.append((block.output.start, block.output.end, result.shown))
                else:
                    problems.append(f"{rel(page)} snippet {n}: the output shown on the page is stale")
    for start, end, shown in sorted(replacements, reverse=True):
        text = text[:start] + shown + text[end:]
    if replacements:
        page.write_text(text)
    return problems


def orphans(update: bool = False) -> list[str]:
    """Golden files no snippet produces any more."""
    wanted = set()
    for page in pages():
        count = sum(b.skip is None for b in blocks(page.read_text())[0])
        wanted |= {golden_path(page, n) for n in range(1, count + 1)}
    stale = sorted(p for p in GOLDEN.rglob("*.txt") if p not in wanted)
    if update:
        for path in stale:
            path.unlink()
        return []
    return [f"{rel(p)}: no snippet produces it" for p in stale]


def _diff(old: str, new: str) -> str:
    import difflib

    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "golden", "now", n=2))
