"""Imports inside hisparse.ops run one way: an op's module imports its ``_*_triton`` kernels
(lazily), never the reverse; what both need lives in a Triton-free module (``_common``,
``block_fp8``, ``moe_tiles``). Read from the source with ``ast``: lazy imports inside functions
count, ``if TYPE_CHECKING:`` blocks (never run) do not."""

import ast
from pathlib import Path

OPS = Path(__file__).resolve().parents[2] / "hisparse" / "ops"
PKG = "hisparse.ops"


def _runtime_nodes(node: ast.AST):
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ``hisparse.ops`` modules (short names) that ``path`` imports at run time."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = f"{PKG}.{node.module}" if node.module else PKG
            elif node.level == 0 and node.module:
                base = node.module
            else:
                continue  # above the package: another layer, not this graph
            # ``from . import x`` / ``from .a import b`` may name submodules as well as objects
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            short = name.removeprefix(PKG + ".")
            if name.startswith(PKG + ".") and short in modules:
                out.add(short)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in OPS.glob("*.py") if p.stem != "__init__"}
    return {m: _imports(OPS / f"{m}.py", modules) for m in sorted(modules)}


def test_no_triton_module_imports_its_reference_module():
    graph = _graph()
    kernels = [m for m in graph if m.startswith("_") and m.endswith("_triton")]
    assert {"_gemm_triton", "_moe_triton", "_resolve_triton"} <= set(kernels)
    bad = {m: m[1:-len("_triton")] for m in kernels if m[1:-len("_triton")] in graph[m]}
    assert not bad, f"kernel modules importing their op's module back: {bad}"


def test_ops_import_graph_has_no_cycles():
    graph = _graph()
    assert "_resolve_triton" in graph["resolve"]   # the lazy imports are seen
    state: dict[str, int] = {}                     # 1 on the DFS stack, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError("import cycle in hisparse.ops: " + " -> ".join(cycle))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


# the Triton-free modules kernels may build on (formats, policy constants, the switches, the
# pending sums a kernel's producer hands its consumer)
SHARED = {"_common", "block_fp8", "moe_tiles", "pending", "switches"}
# the one kernel module still reaching into an op module: FP8KeyLayout and the dequantized
# queries of its multi-tile fallback (quant)
UPWARD = {"_indexer_triton": {"quant"}}


def test_triton_modules_import_only_shared_modules_and_other_kernels():
    graph = _graph()
    kernels = {m for m in graph if m.startswith("_") and m.endswith("_triton")}
    bad = {m: graph[m] - SHARED - kernels - UPWARD.get(m, set()) for m in sorted(kernels)}
    assert not {m: d for m, d in bad.items() if d}, bad
    assert graph["switches"] == set()          # read by everything: imports nothing of ops
