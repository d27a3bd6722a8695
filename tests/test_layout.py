"""The shape of the code, as docs/design.md gives it: imports go down the layer table only,
no import cycle anywhere in honing/ (imports inside functions count), no module over 500
lines. The table is read from the document itself, so code and map cannot drift apart."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "honing"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of honing/."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(target: str) -> str | None:
    """The module of ours an import names (``honing.a.b.name`` -> ``honing.a.b``)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _imports(module: str, path: Path) -> set[str]:
    """The modules of ours ``module`` imports anywhere in its file."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                package = parts if path.name == "__init__.py" else parts[:-1]
                prefix = ".".join(package[: len(package) - node.level + 1])
                base = f"{prefix}.{base}" if base else prefix
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            found = _resolve(name) if name.split(".")[0] == "honing" else None
            # a module importing its own package (its __init__) is not an edge
            if found and found != module and not module.startswith(found + "."):
                targets.add(found)
    return targets


EDGES = {module: _imports(module, path) for module, path in MODULES.items()}


def _layers() -> dict[str, int]:
    """``honing/x/`` or ``honing/x.py`` -> its layer, from docs/design.md's table."""
    table = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    layers = {}
    for number, packages in re.findall(r"^\| (\d) \| (.+?) \|", table, re.MULTILINE):
        for entry in re.findall(r"`(honing/[^`]+)`", packages):
            layers[entry] = int(number)
    return layers


LAYERS = _layers()


def layer_of(module: str) -> int:
    """The layer of a module: that of the table's entry holding its file."""
    path = MODULES[module].relative_to(ROOT).as_posix()
    holding = [e for e in LAYERS if path == e or (e.endswith("/") and path.startswith(e))]
    assert holding, f"{path} is in no layer of docs/design.md's table"
    return LAYERS[max(holding, key=len)]


def test_the_table_is_read_and_covers_every_module():
    assert len(LAYERS) >= 15 and LAYERS["honing/pipeline/"] == 4
    for module in MODULES:
        layer_of(module)


def test_imports_go_down_the_layers_only():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in EDGES.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def _cycles() -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in EDGES[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(EDGES):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert _cycles() == []


def test_a_cycle_would_be_found():
    """The search itself: two modules importing each other are a cycle."""
    saved = dict(EDGES)
    try:
        EDGES["honing.seeds"] = EDGES["honing.seeds"] | {"honing.errors"}
        EDGES["honing.errors"] = EDGES["honing.errors"] | {"honing.seeds"}
        assert _cycles() == [["honing.errors", "honing.seeds"]]
    finally:
        EDGES.clear()
        EDGES.update(saved)


def test_imports_inside_functions_count():
    """``backends.launch`` imports the Ray backend inside ``train``: that edge is seen."""
    assert "honing.backends.ray_run" in EDGES["honing.backends.launch"]


def test_no_module_is_over_500_lines():
    long = {
        name: count
        for name, path in MODULES.items()
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_modules_kept_on_one_worker_exist():
    """A module renamed away from ``ONE_WORKER`` would lose its group without a sound."""
    from tests.conftest import ONE_WORKER

    assert [path for path in ONE_WORKER if not (ROOT / path).is_file()] == []


def test_the_sandbox_imports_nothing_beside_it():
    """The sandbox is below the rewards and the tools that run programs in it: it may import
    its own package and layers 0-1, nothing of layer 2."""
    upward = [
        f"{module} imports {target}"
        for module, targets in EDGES.items()
        if module.startswith("honing.sandbox")
        for target in sorted(targets)
        if not target.startswith("honing.sandbox") and layer_of(target) >= 2
    ]
    assert not upward, "\n".join(upward)


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("honing", "tests", "benchmarks", "examples", "deploy", "docs", ".ci")
PACKAGES = {path.name for path in PACKAGE.iterdir() if path.is_dir()}


def _named_path(token: str) -> Path | None:
    """The file or folder a doc's backticked ``token`` names (``rollout/base.py``,
    ``rollout/tools/calls.FORMATS``, ``honing/sandbox/``), or None where it is no path of ours
    (a metric name such as ``rollout/spec_enabled``, a URL, a glob, a command line)."""
    head, _, last = token.rpartition("/")
    top = token.split("/")[0]
    if not head or any(c in token for c in " *{:<>") or top not in TOP + tuple(PACKAGES):
        return None
    if last and "." not in last:  # no file, module or folder: a metric or a run's directory
        return None
    if top in PACKAGES:
        head = f"honing/{head}"
    if not last or (ROOT / head / last).exists():
        return ROOT / head / last
    return ROOT / head / (last.split(".")[0] + ".py")  # a module's attribute


def test_every_path_the_docs_name_exists():
    """A file renamed or moved without its mention in the README or docs/ fails here."""
    missing = [
        f"{doc.name}: `{token}`"
        for doc in DOCS
        for token in re.findall(r"`([^`\n]+)`", doc.read_text(encoding="utf-8"))
        if (path := _named_path(token)) is not None and not path.exists()
    ]
    assert not missing, "\n".join(missing)


def test_a_missing_path_in_the_docs_would_be_found():
    assert _named_path("rollout/tools/calls.FORMATS") == PACKAGE / "rollout/tools/calls.py"
    assert not _named_path("rollout/no_such_module.py").exists()
    assert _named_path("trainer.sequence_parallel=2") is None
    assert _named_path("rollout/spec_enabled") is None


def test_the_vllm_plugin_entry_point_names_a_module_that_is_there():
    """vLLM loads ``honing``'s plugin by the entry point pyproject.toml declares: a module
    moved without it would leave every vLLM server without honing's transfer backend."""
    import importlib
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    target = project["entry-points"]["vllm.general_plugins"]["honing"]
    module, _, function = target.partition(":")
    assert module in MODULES and callable(getattr(importlib.import_module(module), function))
    registered = re.findall(r'"(honing\.[a-z_.]+)"', MODULES[module].read_text(encoding="utf-8"))
    assert registered and all(name in MODULES for name in registered)
