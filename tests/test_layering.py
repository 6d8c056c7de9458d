"""One-way dependencies: kernels and loader never import the engine or the server; the engine never
imports the server (except strata_lite/cli.py, the command line, which sits above everything);
cupy/numba.cuda only inside kernels/cuda."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "kernels": ("strata_lite.server", "strata_lite.loader", "strata_lite.api", "strata_lite.models",
                "strata_lite.engine", "strata_lite.scheduler"),
    "loader": ("strata_lite.server", "strata_lite.api", "strata_lite.models", "strata_lite.engine",
               "strata_lite.scheduler"),
    "strata_lite": ("strata_lite.server",),
}
PACKAGE_OF = {"kernels": "strata_lite.kernels", "loader": "strata_lite.loader", "strata_lite": "strata_lite"}


def _imports(path: Path, package: str):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel_pkg = package + "." + ".".join(path.relative_to(ROOT / path.relative_to(ROOT).parts[0]).parts[:-1])
    rel_pkg = rel_pkg.rstrip(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = rel_pkg.split(".")
                base = base[:len(base) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module


def test_dependency_direction():
    bad = []
    for folder, banned in FORBIDDEN.items():
        for path in (ROOT / folder).rglob("*.py"):
            exempt = ("strata_lite.server",) if path == ROOT / "strata_lite" / "cli.py" else ()
            for mod in _imports(path, PACKAGE_OF[folder]):
                if any(mod == b or mod.startswith(b + ".") for b in banned if b not in exempt):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
                if mod.split(".")[0] == "cupy" and "cuda" not in path.parts:
                    bad.append(f"{path.relative_to(ROOT)} imports cupy outside kernels/cuda")
    assert not bad, "\n".join(bad)
