"""The package's imports run one way: numerics/config/tokens at the bottom, then the tokenizer and the
checkpoint, kernels, model, engine, golden, split, server, and the commands at the top. Every import of
`dsflash/` is read with `ast` (deferred ones too: an import inside a function cannot hide a loop)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dsflash"

# the layers from the bottom up; a module may import from its own layer's package or from a lower layer
LAYERS = (
    ("dsflash.numerics", "dsflash.tokens"),
    ("dsflash.config",),
    ("dsflash.tokenizer", "dsflash.checkpoint"),
    ("dsflash.kernels", "dsflash.parallel"),  # the process group beside the kernels: the model's collectives
    ("dsflash.model",),
    ("dsflash.engine",),
    ("dsflash.golden",),
    ("dsflash.split",),
    ("dsflash.server",),
    ("dsflash.bench",),  # benchmarks drive the engine, the split and the kernels
    ("dsflash.train",),  # training drives the model through its own kernels; its chat data is the server's
)
COMMANDS = len(LAYERS)  # the CLI and every `*_cmd.py`, above everything


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each dsflash module's dsflash imports, as module names (`from a import b` counts `a.b` when that is
    a module, else `a`)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for mod, path in files.items():
        found = out[mod] = set()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("dsflash"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                if not base.startswith("dsflash"):
                    continue
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        found.discard(mod)
    return out


def layer(mod: str) -> int:
    if mod == "dsflash":  # the package's face (its __init__ holds no code)
        return 0
    if mod == "dsflash.cli" or mod.endswith("_cmd"):
        return COMMANDS
    for i, names in enumerate(LAYERS):
        if any(mod == n or mod.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{mod} belongs to no layer: add it to LAYERS in tests/test_layers.py")


def test_no_import_points_up():
    upward = [f"{mod} (layer {layer(mod)}) imports {dep} (layer {layer(dep)})"
              for mod, deps in sorted(imports().items()) for dep in sorted(deps)
              if layer(dep) > layer(mod)]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_commands_are_imported_by_the_cli_alone():
    wrong = [f"{mod} imports {dep}" for mod, deps in sorted(imports().items()) for dep in sorted(deps)
             if dep.endswith("_cmd") and mod != "dsflash.cli"]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = imports()
    cycles, state = [], {}

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = "open"
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_scan_sees_imports():
    """The checks above are only as good as the scan: it must see plain, from- and deferred imports."""
    graph = imports()
    assert "dsflash.model.transformer" in graph["dsflash.engine.session"]
    assert "dsflash.numerics" in graph["dsflash.kernels.cpu"]
    assert any(dep.startswith("dsflash.server") for dep in graph["dsflash.server.serve_cmd"])  # deferred ones
