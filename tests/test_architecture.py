"""The house's structure, read from the code: imports go down the layers docs/design.md lists and never in a loop,
engines are peers reached only through the registry, no module outgrows ~600 lines, no engine is named outside
sim/engines/, and each of the engines' reserve and budget knobs is read in one module."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "sim"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 600
# The spec and what every engine and run shares: the only sim.engines modules a module outside them may import.
ENGINE_SPEC = ("sim.engines", "sim.engines.base", "sim.engines.records", "sim.engines.recorder")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SIM.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The sim modules `name` imports, at module level or inside functions (`from a import b` names the submodule
    a.b when there is one, else the module a)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layers() -> list[tuple[str, list[str]]]:
    """docs/design.md's layer table, top to bottom: (layer, module patterns)."""
    text = DESIGN.read_text()
    table = text.split("<!-- import-layers -->", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    return [(row.split("|")[1].strip(), re.findall(r"`([^`]+)`", row.split("|")[2])) for row in rows]


def layer_of(module: str, table: list) -> int:
    """The row whose most specific pattern names the module: an exact name first, then the longest pattern."""
    best = None
    for i, (_, patterns) in enumerate(table):
        for pattern in patterns:
            if fnmatch.fnmatchcase(module, pattern):
                rank = (pattern == module, len(pattern))
                if best is None or rank > best[0]:
                    best = (rank, i)
    assert best is not None, f"{module} is in no layer of docs/design.md"
    return best[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_imports_only_go_down_the_layers_of_the_design():
    table = layers()
    assert len(table) >= 10 and table[0][1][0] == "sim"
    upward = []
    for module, targets in graph().items():
        mine = layer_of(module, table)
        upward += [f"{module} ({table[mine][0]}) imports {t} ({table[layer_of(t, table)][0]})" for t in sorted(targets)
                   if layer_of(t, table) < mine]
    assert upward == []


def test_no_two_modules_import_each_other_directly_or_in_a_loop():
    assert cycles(graph()) == []


def test_the_checks_catch_what_they_are_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    table = [("top", ["sim", "sim.cli*"]), ("engines", ["sim.engines.*"]), ("spec", ["sim.engines.base"])]
    assert [layer_of(m, table) for m in ("sim.cli", "sim.engines.ds4.process", "sim.engines.base")] == [0, 1, 2]


def engine_packages() -> set[str]:
    return {p.parent.name for p in (SIM / "engines").glob("*/__init__.py")}


def test_engines_are_peers_reached_through_the_registry():
    packages = engine_packages()
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            parts = target.split(".")
            if len(parts) < 3 or parts[:2] != ["sim", "engines"] or parts[2] not in packages:
                continue  # not inside an engine package
            mine = module.split(".")
            inside = len(mine) >= 3 and mine[:2] == ["sim", "engines"] and mine[2] in packages
            if (inside and mine[2] != parts[2]) or (not inside and module != "sim.engines"):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_module_is_over_600_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: n for name, n in long.items() if n > MAX_LINES} == {}


def _code(path: Path):
    """The module's AST nodes less its docstrings (a docstring may name anything)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node for node in ast.walk(tree) if id(node) not in docstrings]


def test_no_engine_is_compared_or_special_cased_outside_sim_engines():
    from sim.engines import ENGINES

    names = set(ENGINES)
    found = []
    for name, path in modules().items():
        if name.startswith("sim.engines"):
            continue
        for node in _code(path):
            literals = []
            if isinstance(node, ast.Compare):
                literals = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                literals = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Subscript):
                literals = [node.slice]
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and isinstance(getattr(node, "ctx", None), ast.Load):
                literals = list(node.elts)
            for literal in literals:
                if isinstance(literal, ast.Constant) and literal.value in names:
                    found.append(f"{name}:{literal.lineno} {literal.value!r}")
    assert found == []


# Each knob as its field is read (an attribute, or getattr's name) and as its scenario key or flag is spelled.
KNOBS = {"strata --vram-reserve-mib": ({"vram_reserve_mib"}, "vram-reserve-mib"),
         "ds4 DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB": ({"DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"},
                                                           "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"),
         "ds4 --ssd-streaming-cache-experts": ({"ssd_streaming_cache_experts"}, "ssd-streaming-cache-experts")}


def readers(fields: set[str], spelling: str) -> set[str]:
    """The modules whose code reads the knob: its field as an attribute or a getattr name, or its key or flag as a
    string of its own (a grid spec or help text that mentions it in a longer string, or an output's key of the same
    spelling, is no reader)."""
    found = set()
    for name, path in modules().items():
        code = _code(path)
        keys = {id(k) for node in code if isinstance(node, ast.Dict) for k in node.keys if k is not None}
        for node in code:
            if id(node) in keys:
                continue
            if isinstance(node, ast.Attribute) and node.attr in fields:
                found.add(name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in fields or node.value.removeprefix("--") == spelling
                    or node.value.rsplit(".", 1)[-1] == spelling and node.value.startswith("engine.")):
                found.add(name)
    return found


@pytest.mark.parametrize("knob", list(KNOBS))
def test_each_knob_is_read_in_one_module(knob):
    fields, spelling = KNOBS[knob]
    assert len(readers(fields, spelling)) == 1, readers(fields, spelling)


# The machine owns every rate (docs/design.md): engine code asks a resource to move bytes and waits on the event it
# gets back; it never reads a rate, divides bytes by one or books a job to start later than it is issued.
RATE_ATTRIBUTE = re.compile(r"gbps|bytes_per_s|s_per_byte|^rates$|^[hd]2[hd]_(pinned|pageable)$", re.IGNORECASE)
RATE_NAME = re.compile(r"gbps|bytes_per_s|s_per_byte|(^|_)rates?($|_)|^[hd]2[hd]_(pinned|pageable)$", re.IGNORECASE)
# What Strata's startup probe measures (probe_pcie_h2d_gbps): an input to its --pcie-frac rule, compared with the
# rule's thresholds, never a price.
RATE_READS_ALLOWED = {"probe_h2d_gbps"}


def _names(node: ast.AST) -> list[str]:
    """The names and attribute names an expression reads."""
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]


def _is_rate(node: ast.AST) -> bool:
    """An expression that is a rate: a rate's name, a rate attribute, or an element of one (rates["h2d_pinned"])."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return bool(RATE_NAME.search(node.id))
    return isinstance(node, ast.Attribute) and bool(RATE_NAME.search(node.attr))


def rate_arithmetic(source: str, where: str = "<code>") -> list[str]:
    """Where code prices bytes itself: a rate attribute read (machine.h2d.bytes_per_s, hw.gpu.dram_bandwidth_gbps,
    machine.rates), a division by a rate (n_bytes / rate; a ratio of two rates is no price), or a job booked ahead
    of its issue (ready_s=)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and RATE_ATTRIBUTE.search(node.attr) and node.attr not in RATE_READS_ALLOWED:
            found.append(f"{where}:{node.lineno} reads .{node.attr}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)) and _is_rate(node.right) \
                and not any(RATE_NAME.search(name) for name in _names(node.left)):
            found.append(f"{where}:{node.lineno} divides by {ast.unparse(node.right)}")
        elif isinstance(node, ast.keyword) and node.arg == "ready_s":
            found.append(f"{where}:{node.value.lineno} books ahead (ready_s=)")
    return found


def test_engines_never_price_bytes_themselves():
    found = []
    for name, path in modules().items():
        if name.startswith("sim.engines."):
            found += rate_arithmetic(path.read_text(), name)
    assert found == []


def test_the_rate_check_catches_what_it_is_for():
    caught = ["t = n_bytes / machine.h2d.bytes_per_s", "t = n / m.rates['h2d_pageable']", "t = n_bytes / rate",
              "s = 1.0 / (hw.gpu.dram_bandwidth_gbps.value * 1e9)", "t = n * run.weight_read_s_per_byte",
              "t = pageable / run.h2d_pageable", "gpu.book(1.0, ready_s=end)", "t = n // self.pool_bytes_per_s"]
    for line in caught:
        assert rate_arithmetic(line), line
    passed = ["f = PCIE_FRAC * probe_gbps / PCIE_PROBE_SCALE_GBPS", "share = hits / lookups",
              "yield m.h2d.copy(n_bytes, 3)", "mib = n_bytes / MIB", "s = m.vram_read_s(n_bytes)"]
    for line in passed:
        assert not rate_arithmetic(line), line
