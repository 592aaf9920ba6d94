"""The package layering contract: product code imports only downwards, and no module of a package takes part
in an import circle with others of its package.

Every import in every product .py file (function-local ones too) is mapped to its top-level package; a
package may import a lower layer, a package of its own layer only along an edge listed in ALLOWED_SAME_LAYER,
and never a higher layer. Imports that still break the rule are listed per module in KNOWN_VIOLATIONS, each
with the move that will end it (per module, so a new bad import elsewhere in the same package still fails);
the list may only shrink: an entry that no longer exists fails the test until it is removed.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NOT_PRODUCT = {"tests"}  # tests may import anything; bench is product code at the top

# Bottom -> top. A package not listed here fails the test: a new package is placed deliberately.
LAYERS: list[set[str]] = [
    {"runbase", "configs"},                      # config loading, Redis namespace, faults, net; YAML files
    {"rewards"},                                 # pure scorers, chosen by a prompt's data_source
    {"buffer", "weightsync", "data", "engines", "envs"},  # the data plane, weight sync, datasets/tasks,
                                                           # generation, multi-turn environments and tools
    {"actors", "learner"},                       # the two roles of a run
    {"cluster"},                                 # the launcher and operator commands
    {"experiments", "bench"},                    # studies and measurements over everything below
]

# One-way imports allowed between packages of one layer (the reverse edge stays forbidden).
ALLOWED_SAME_LAYER: dict[tuple[str, str], str] = {
    ("engines", "weightsync"): "engines receive published weights in weightsync.flat's bucket layout",
    ("engines", "data"): "the held-out evaluation feeds an engine the prompt queue's records (data.tasks.token_ids)",
    ("data", "envs"): "an environment's prompts and its warm-up model are built from its records and episodes",
}

# (module, package it imports) pairs that break the layering today; each goes when its move is done.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
}


def product_packages(root: Path) -> list[str]:
    """Top-level packages of product code: folders with an __init__.py, tests aside."""
    return sorted(p.name for p in root.iterdir()
                  if (p / "__init__.py").is_file() and p.name not in NOT_PRODUCT)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`; relative imports stay in their package."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def module_edges(root: Path, packages: list[str]) -> dict[tuple[str, str], list[str]]:
    """(importing module, imported top-level package) -> 'line module' of each such import."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            for line, module in imported_modules(path.read_text()):
                target = module.split(".")[0]
                if target in packages and target != pkg:
                    edges[(name, target)].append(f"{line} {module}")
    return edges


def layer_of(layers: list[set[str]]) -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(layers) for pkg in layer}


def violations(edges, layers, allowed_same_layer) -> set[tuple[str, str]]:
    """The (module, package) edges that import upwards, or sideways along a package edge not allowed."""
    level = layer_of(layers)
    bad = set()
    for module, b in edges:
        a = module.split(".")[0]
        if level[a] < level[b] or (level[a] == level[b] and (a, b) not in allowed_same_layer):
            bad.add((module, b))
    return bad


def test_rule_on_a_small_graph():
    layers = [{"base"}, {"mid1", "mid2"}, {"top"}]
    edges = {("top.x", "base"): [], ("mid1.x", "base"): [], ("mid1.x", "mid2"): [], ("mid2.y", "mid1"): [],
             ("base.z", "top"): []}
    assert violations(edges, layers, {("mid1", "mid2"): ""}) == {("mid2.y", "mid1"), ("base.z", "top")}


def test_every_package_has_a_layer():
    placed = layer_of(LAYERS)
    assert len(placed) == sum(len(layer) for layer in LAYERS), "a package is listed in two layers"
    missing = set(product_packages(ROOT)) - set(placed)
    assert not missing, f"place these packages in LAYERS (tests/unit/test_layers.py): {sorted(missing)}"
    for a, b in list(ALLOWED_SAME_LAYER) + list(KNOWN_VIOLATIONS):
        assert a.split(".")[0] in placed and b in placed, f"unknown package in the edge {a} -> {b}"


def test_imports_follow_the_layers():
    edges = module_edges(ROOT, product_packages(ROOT))
    bad = violations(edges, LAYERS, ALLOWED_SAME_LAYER)
    new = sorted(bad - set(KNOWN_VIOLATIONS))
    assert not new, "imports against the layer order (LAYERS in tests/unit/test_layers.py):\n" + "\n".join(
        f"  {a} -> {b}: " + ", ".join(edges[(a, b)]) for a, b in new)
    gone = sorted(set(KNOWN_VIOLATIONS) - bad)
    assert not gone, f"these KNOWN_VIOLATIONS no longer exist; delete them from the list: {gone}"


def module_name(root: Path, path: Path) -> str:
    """The dotted name a file is imported by (a package's __init__.py: the package's)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_graph(root: Path, pkg: str) -> dict[str, set[str]]:
    """module -> the modules of its own package it imports, function-local imports too (`from a import b`
    names the module a.b where that is one)."""
    files = {module_name(root, p): p for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        graph[name] = {n for n in names if n in files and n != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another round a circle (strongly connected components of more
    than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_circle_rule_on_a_small_graph():
    graph = {"p.core": {"p.hf"}, "p.hf": {"p.core", "p.util"}, "p.util": set(), "p.a": {"p.b"}, "p.b": {"p.c"},
             "p.c": {"p.a"}, "p.factory": {"p.hf", "p.core"}}
    assert import_circles(graph) == [["p.a", "p.b", "p.c"], ["p.core", "p.hf"]]
    graph["p.core"] = set()   # the interface imports no backend: a factory beside them picks one
    assert import_circles(graph) == [["p.a", "p.b", "p.c"]]


def test_a_local_import_makes_a_circle_too(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "p" / "core.py").write_text("def build():\n    from p.hf import Engine  # lazy\n    return Engine\n")
    (tmp_path / "p" / "hf.py").write_text("from p import core\n")
    assert import_circles(package_graph(tmp_path, "p")) == [["p.core", "p.hf"]]


@pytest.mark.parametrize("pkg", product_packages(ROOT))
def test_no_import_circle_inside_a_package(pkg):
    """Modules of one package import one another one way: an interface module imports none of its
    implementations (a factory beside them chooses one, as engines/backends.py and weightsync/backends.py do),
    even inside a function."""
    circles = import_circles(package_graph(ROOT, pkg))
    assert not circles, f"import circles in {pkg}/: " + "; ".join(" <-> ".join(c) for c in circles)


def local_project_imports(root: Path, packages: list[str]) -> list[tuple[str, int, str]]:
    """(file, line, text) of every import of a project module made inside a function."""
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            src = path.read_text()
            lines = src.split("\n")
            for fn in ast.walk(ast.parse(src)):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                             else [])
                    if any(n.split(".")[0] in packages for n in names):
                        out.append((str(path.relative_to(root)), node.lineno, lines[node.lineno - 1].strip()))
    return sorted(set(out))


def test_project_imports_sit_at_the_top_unless_a_comment_says_why_not():
    """A module's project imports are at its top, where a reader sees its dependencies; one inside a
    function must say why on its line (it loads a heavy library such as torch that the caller does without,
    or is an optional part)."""
    bare = [f"{f}:{n} {text}" for f, n, text in local_project_imports(ROOT, product_packages(ROOT)) if "#" not in text]
    assert not bare, "imports inside functions without a reason (move them to the top, or comment):\n  " + \
        "\n  ".join(bare)


# The packages whose code runs in a job's hot paths: fault injection never reaches into them (the chaos tests'
# fault points wrap their methods from outside, tests/chaos/faultpoints.py, loaded only when a test asks).
NO_FAULT_HOOKS = ("learner", "buffer", "actors", "weightsync")


def imports_faults(source: str) -> list[int]:
    """Lines of `source` that import runbase.faults (as a module, or its names)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name == "runbase.faults" for a in node.names):
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module == "runbase.faults" or (node.module == "runbase" and
                                                    any(a.name == "faults" for a in node.names))):
            out.append(node.lineno)
    return out


def test_imports_faults_sees_every_form():
    assert imports_faults("import runbase.faults\nfrom runbase import faults, keys\nfrom runbase.faults import die\n"
                          "from runbase import keys\n") == [1, 2, 3]


def test_fault_injection_stays_out_of_the_roles_code():
    found = [f"{path.relative_to(ROOT)}:{line}" for pkg in NO_FAULT_HOOKS
             for path in sorted((ROOT / pkg).rglob("*.py")) for line in imports_faults(path.read_text())]
    assert not found, f"fault hooks in product code (wrap the method from tests/chaos/faultpoints.py): {found}"


# Libraries that take seconds to import: neither the base nor an operator's --help may pull them in.
# (runbase.net imports ray lazily, inside local_host, only where a process asks Ray for its address.)
HEAVY = ("torch", "transformers", "vllm")


@pytest.mark.parametrize("pkg,below", [("runbase", set()), ("rewards", {"runbase"})])
def test_base_and_rewards_import_nothing_above_and_no_heavy_library(pkg, below):
    packages = set(product_packages(ROOT))
    found = [f"{path.relative_to(ROOT)}:{line} {module}"
             for path in sorted((ROOT / pkg).rglob("*.py"))
             for line, module in imported_modules(path.read_text())
             if module.split(".")[0] in (packages - {pkg} - below) | set(HEAVY)]
    assert not found, f"{pkg} sits at the bottom and is torch-free: {found}"


# Imports the module as `python -m` would, with --help, then prints the heavy libraries it loaded.
_HELP_PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print("HEAVY", sorted({m.split(".")[0] for m in sys.modules} & set(%r)))
""" % (HEAVY,)


@pytest.mark.parametrize("module", ["cluster.status"])
def test_operator_help_does_not_import_torch(module):
    proc = subprocess.run([sys.executable, "-c", _HELP_PROBE, module], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # a --help that takes a minute is itself a bug
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout, proc.stdout  # the probe really ran the command's --help
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []", proc.stdout
