"""The first lines users type: the submodules import every way, `python -m sdpq` runs, and
`import sdpq` alone imports neither torch.distributed's frameworks nor DeepSpeed; and the import
graph read from the source: layers point downward, no cycle between sub-packages, private
modules stay inside their package."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120).stdout


def test_import_sdpq_imports_no_framework():
    out = _python(
        "import sys, sdpq; print('deepspeed' in sys.modules, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    assert out.split() == ["False", "False", "False"]


def test_fsdp_submodule_every_way():
    out = _python(
        "import sdpq.fsdp\nfrom sdpq.fsdp import apply, state_dict\nimport sdpq\n"
        "print(sdpq.fsdp.apply is apply, sdpq.fsdp.state_dict is state_dict)"
    )
    assert out.split() == ["True", "True"]


def test_deepspeed_submodule_every_way():
    pytest.importorskip("deepspeed")
    out = _python(
        "import sdpq.deepspeed\nfrom sdpq.deepspeed import initialize\nimport sdpq\n"
        "print(sdpq.deepspeed.initialize is initialize)"
    )
    assert out.split()[-1] == "True"


def test_attribute_access_imports_on_demand():
    out = _python("import sdpq\nprint(sdpq.fsdp.__name__, callable(sdpq.fsdp.apply))")
    assert out.split() == ["sdpq.fsdp", "True"]


def test_python_dash_m_sdpq():
    out = subprocess.run(
        [sys.executable, "-m", "sdpq", "--help"], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    assert "usage: sdpq" in out and "bench" in out


def test_deepspeed_initialize_is_wrapped_after_import_sdpq_whatever_the_order():
    pytest.importorskip("deepspeed")
    for order in ("import deepspeed, sdpq", "import sdpq, deepspeed"):
        out = _python(f"{order}\nprint(hasattr(deepspeed.initialize, '__sdpq_original__'))")
        assert out.split()[-1] == "True", order


def test_sdpq_config_imports_no_benchmark_and_no_torch_distributed(tmp_path):
    """`sdpq config --check` is what users run on a login node: it must not import the benchmark
    modules (their imports reach torch.distributed)."""
    path = tmp_path / "ds.json"
    path.write_text(
        '{"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}, '
        '"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "sdpq": {"weights": {}}}'
    )
    out = _python(
        f"import sys\nfrom sdpq.cli import main\nassert main(['config', '--check', {str(path)!r}]) == 0\n"
        "print('RESULT', 'torch.distributed' in sys.modules, any(m.startswith('sdpq.bench.') for m in sys.modules))"
    )
    assert out.split()[-2:] == ["False", "False"], out


def test_version_pins_are_stated_once():
    """pyproject.toml's ranges are the ones the code enforces and the docs state."""
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("deepspeed")
    from pathlib import Path

    from sdpq.integrations.deepspeed import TESTED_DEEPSPEED

    root = Path(__file__).parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    deepspeed_pin = f"deepspeed>={TESTED_DEEPSPEED[0]},<{TESTED_DEEPSPEED[1]}"
    assert project["optional-dependencies"]["deepspeed"] == [deepspeed_pin]
    assert f'"{deepspeed_pin}"' in (root / "run").read_text()  # what ./run installs before the extras
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert f"torch >= {torch_pin.split('>=')[1]};" in (root / "docs" / "fsdp.md").read_text()
    assert f"`{torch_pin}`" in (root / "README.md").read_text()


def test_tested_torch_versions_are_the_claimed_ones():
    """pyproject.toml claims no older torch than was tested, and the README's tested-versions
    line names exactly the releases the FSDP2 internals were checked against."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from sdpq.integrations._fsdp_internals import CHECKED_TORCH

    root = Path(__file__).parents[1]
    torch_pin = next(
        d
        for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    oldest = tuple(int(x) for x in CHECKED_TORCH[0].split(".")[:2])
    assert torch_pin == f"torch>={oldest[0]}.{oldest[1]}"
    assert f"**Tested torch versions: {', '.join(CHECKED_TORCH)}**" in (root / "README.md").read_text()


# ---------------------------------------------------------------------------- the import graph
# Read from the source with ast (nothing is imported), so a cycle or an upward import shows here
# even where it happens inside a function.

SDPQ = Path(__file__).parents[1] / "sdpq"


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path = SDPQ) -> dict[str, set[str]]:
    """Every module of the package at `root` -> the modules of that package it imports (at any
    depth: functions included). ``from a import b`` is an import of ``a.b`` where that is a module."""
    modules = _module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _package(module: str) -> str:
    """The first level under sdpq: a sub-package or a top-level module (sdpq.comm.grads -> comm)."""
    return module.split(".")[1] if "." in module else ""


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Sub-package -> the sub-packages it imports. The root package (`sdpq/__init__.py`, the front
    door that imports the rest lazily) is no layer and stays out."""
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        if _package(src):
            out.setdefault(_package(src), set()).update(
                _package(t) for t in targets if _package(t) not in ("", _package(src))
            )
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_imports_of_quant(graph: dict[str, set[str]]) -> list[str]:
    """`sdpq.quant` is the PyTorch reference math: it imports nothing of sdpq outside itself."""
    return sorted(
        f"{m} -> {t}" for m, ts in graph.items() if _package(m) == "quant" for t in ts if _package(t) != "quant"
    )


def private_imports_from_outside(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a private module (`a.b._c`) by a module outside its package (`a.b`)."""
    bad = []
    for src, targets in graph.items():
        for t in targets:
            parts = t.split(".")
            first = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
            if first is not None and not (src + ".").startswith(".".join(parts[:first]) + "."):
                bad.append(f"{src} -> {t}")
    return sorted(bad)


def test_quant_imports_nothing_above_it():
    graph = import_graph()
    assert {"sdpq.quant", "sdpq.quant.groupwise", "sdpq.kernels.dispatch"} <= graph.keys()  # the graph is read
    assert "sdpq.quant" in graph["sdpq.kernels.dispatch"] or "sdpq.quant.rows" in graph["sdpq.kernels.dispatch"]
    assert upward_imports_of_quant(graph) == []
    for above in ("kernels", "comm", "optim", "integrations"):
        assert not any(_package(t) == above for m, ts in graph.items() if _package(m) == "quant" for t in ts)


def test_no_cycle_between_subpackages():
    packages = package_graph(import_graph())
    assert "kernels" in packages["comm"] and "quant" in packages["kernels"]  # the edges that exist are seen
    assert _cycles(packages) == []


def test_layers_point_downward():
    """quant <- kernels <- comm <- optim (its guard asks comm where a group's buffers live) <-
    integrations: no sub-package imports one drawn above it."""
    order = ["quant", "kernels", "comm", "optim", "integrations"]
    packages = package_graph(import_graph())
    upward = [
        f"{p} -> {t}" for p in order for t in packages.get(p, ()) if t in order and order.index(t) > order.index(p)
    ]
    assert upward == []


def test_private_modules_are_imported_only_inside_their_package():
    assert private_imports_from_outside(import_graph()) == []


def test_the_graph_checks_see_what_they_look_for():
    """The checks above on a made-up graph: an upward import, a cycle and a private import each show."""
    graph = {
        "sdpq.quant.rows": {"sdpq.kernels.dispatch"},
        "sdpq.kernels.dispatch": {"sdpq.quant.rows"},
        "sdpq.integrations.fsdp": {"sdpq.comm._exchange"},
        "sdpq.comm._exchange": set(),
    }
    assert upward_imports_of_quant(graph) == ["sdpq.quant.rows -> sdpq.kernels.dispatch"]
    assert _cycles(package_graph(graph)) == [["kernels", "quant"]]
    assert private_imports_from_outside(graph) == ["sdpq.integrations.fsdp -> sdpq.comm._exchange"]
