"""DeepSpeed's private names appear in sdpq's source only in its DeepSpeed internals files
(sdpq/integrations/_ds_zero3_internals.py, _ds_zero12_internals.py, _ds_engine_internals.py),
read from the source with ast (nothing of sdpq is imported to check it).

What counts as a DeepSpeed private name, in any module under sdpq/:
- an import of a DeepSpeed module outside its public API (`PUBLIC_MODULES`): `import deepspeed.X`,
  `from deepspeed.X import ...`, `from deepspeed import X` of such a module, or a string naming it
  (`importlib.import_module("deepspeed.X")`);
- a name with one leading underscore that DeepSpeed's installed source defines (a function,
  method or class, an attribute it assigns on `self`, a module- or class-level name), used as an
  attribute (`obj._name`, read, written or deleted) or as a string (`getattr(obj, "_name")`,
  `patch(obj, "_name", ...)`); and any name-mangled private method of a DeepSpeed class
  (`_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads`).
A name sdpq defines itself outside the internals files (`def _name`, `self._name = ...`, a
module-level `_name`) is sdpq's own wherever it is used; `OTHER_OWNERS` lists the names that
DeepSpeed happens to define too but that sdpq uses for other objects. Not counted: DeepSpeed's
public attributes (`engine.optimizer`, `engine.global_steps`, ZeRO-3's `ds_*` parameter attributes).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).parents[2]
SDPQ = ROOT / "sdpq"
INTERNALS = {
    "sdpq/integrations/_ds_zero3_internals.py",
    "sdpq/integrations/_ds_zero12_internals.py",
    "sdpq/integrations/_ds_engine_internals.py",
}
PUBLIC_MODULES = ("deepspeed", "deepspeed.comm", "deepspeed.zero", "deepspeed.utils", "deepspeed.accelerator")
# Names DeepSpeed defines that sdpq uses for objects of its own or of other libraries.
OTHER_OWNERS = {
    "_replace": "NamedTuple._replace (sdpq/comm/grads.py)",
    "_dtype": "the key of sdpq.optim's compressed states (sdpq/optim/wrapper.py)",
}


def _deepspeed_root() -> Path | None:
    spec = importlib.util.find_spec("deepspeed")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


_DEFINES = re.compile(
    r"^\s*(?:async\s+)?def\s+(_\w+)|^\s*class\s+(\w+)|self\.(_\w+)\s*(?::[^=\n]*)?=(?!=)|^\s*(_\w+)\s*(?::[^=\n]*)?=(?!=)",
    re.M,
)


@functools.cache
def deepspeed_private_names() -> tuple[frozenset[str], re.Pattern]:
    """(the single-underscore names DeepSpeed's source defines, a pattern of its mangled private
    method names). Read as text (about a second for the whole package)."""
    root = _deepspeed_root()
    assert root is not None
    names: set[str] = set()
    classes: set[str] = set()
    for path in root.rglob("*.py"):
        for m in _DEFINES.finditer(path.read_text(errors="replace")):
            fn, cls, attr, var = m.groups()
            if cls:
                classes.add(cls.lstrip("_"))
            names.update(x for x in (fn, attr, var) if x)
    single = frozenset(n for n in names if not n.startswith("__"))
    methods = sorted(n for n in names if n.startswith("__") and not n.endswith("__"))
    mangled = re.compile(rf"_(?:{'|'.join(map(re.escape, sorted(classes)))})(?:{'|'.join(map(re.escape, methods))})")
    return single, mangled


def _private_module(name: str) -> bool:
    if name != "deepspeed" and not name.startswith("deepspeed."):
        return False
    return not any(name == p for p in PUBLIC_MODULES)


def sdpq_own_names(sources: dict[str, str]) -> set[str]:
    """The underscore names sdpq defines itself outside the internals files."""
    own: set[str] = set()
    for rel, text in sources.items():
        if rel in INTERNALS:
            continue
        for node in ast.walk(_parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return {n for n in own if n.startswith("_")}


_BY_NAME = {"getattr", "setattr", "hasattr", "delattr", "patch"}


class Use(NamedTuple):
    """One DeepSpeed private name in sdpq's source."""

    file: str
    line: int
    name: str  # the module or attribute named
    how: str  # "import", "attribute" or "string"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.how} {self.name}"


def private_uses(rel: str, text: str, own: set[str]) -> list[Use]:
    """Every DeepSpeed private name in one module's source (see the module docstring)."""
    single, mangled = deepspeed_private_names()
    private = single - own - OTHER_OWNERS.keys()

    def named(x: str) -> bool:
        return x in private or bool(mangled.fullmatch(x))

    out = []
    for node in ast.walk(_parse(text)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            out += [Use(rel, line, a.name, "import") for a in node.names if _private_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private_module(node.module):
                out.append(Use(rel, line, node.module, "import"))
            elif node.module == "deepspeed":
                out += [Use(rel, line, f"deepspeed.{a.name}", "import") for a in node.names if _submodule(a.name)]
        elif isinstance(node, ast.Attribute) and named(node.attr):
            out.append(Use(rel, line, node.attr, "attribute"))
        elif isinstance(node, ast.Call) and _called(node) in _BY_NAME:
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            out += [Use(rel, line, v, "string") for v in strings if v in private]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value
            if mangled.fullmatch(v) or (re.fullmatch(r"deepspeed(\.\w+)+", v) and _private_module(v)):
                out.append(Use(rel, line, v, "string"))
    return sorted(set(out), key=lambda u: (u.line, u.how, u.name))


@functools.cache
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def _called(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _submodule(name: str) -> bool:
    root = _deepspeed_root()
    assert root is not None
    return f"deepspeed.{name}" not in PUBLIC_MODULES and ((root / name).is_dir() or (root / f"{name}.py").exists())


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(SDPQ.rglob("*.py"))}


needs_deepspeed = pytest.mark.skipif(_deepspeed_root() is None, reason="DeepSpeed is not installed")


@needs_deepspeed
def test_no_deepspeed_private_name_outside_the_internals_files():
    sources = _sources()
    assert INTERNALS <= sources.keys()
    own = sdpq_own_names(sources)
    found = [str(u) for rel, text in sources.items() if rel not in INTERNALS for u in private_uses(rel, text, own)]
    assert found == [], "move these into the DeepSpeed internals files:\n" + "\n".join(found)
    # The internals files do use private names (the check sees them) and name each in their docstring.
    for rel in sorted(INTERNALS):
        uses = private_uses(rel, sources[rel], own)
        assert uses, rel
        doc = ast.get_docstring(_parse(sources[rel])) or ""
        unnamed = sorted({u.name for u in uses if not re.search(rf"\b{re.escape(u.name)}\b", doc)})
        assert unnamed == [], f"{rel} uses {unnamed} without naming them in its docstring"
    # Every exception is still needed: sdpq uses the name (for its own objects).
    for name in OTHER_OWNERS:
        assert any(re.search(rf"""[.'"]{re.escape(name)}\b""", t) for t in sources.values()), name


@needs_deepspeed
def test_the_check_finds_a_planted_private_name():
    """The check on a real adapter file with DeepSpeed private names planted into it: each is
    found, and the file as it is comes out clean."""
    sources = _sources()
    own = sdpq_own_names(sources)
    rel = "sdpq/integrations/_ds_adapter.py"
    assert private_uses(rel, sources[rel], own) == []
    n = sources[rel].count("\n")
    planted = sources[rel] + (
        "def _planted(engine):\n"
        "    import deepspeed.runtime.zero.stage3 as stage3\n"
        "    from deepspeed.runtime.utils import see_memory_usage\n"
        "    opt = engine.optimizer\n"
        "    opt._reassign_or_swap_out_partitioned_parameters(0)\n"
        '    getattr(opt, "_get_param_partition_group")\n'
        '    return "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", stage3, see_memory_usage\n'
    )
    found = [(u.line - n, u.how, u.name) for u in private_uses(rel, planted, own)]
    assert found == [
        (2, "import", "deepspeed.runtime.zero.stage3"),
        (3, "import", "deepspeed.runtime.utils"),
        (5, "attribute", "_reassign_or_swap_out_partitioned_parameters"),
        (6, "string", "_get_param_partition_group"),
        (7, "string", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
    ], found
    # DeepSpeed's public modules and attributes, and sdpq's own underscore names, are not counted.
    clean = "import deepspeed.comm\nfrom deepspeed import zero\ndef f(self, p):\n    return p.ds_tensor, self._index\n"
    assert private_uses(rel, clean, own) == []


@needs_deepspeed
def test_the_checked_versions_agree():
    """Each internals file states the DeepSpeed releases it was checked against; the lowest
    release sdpq.deepspeed accepts is the oldest of them."""
    from packaging.version import Version

    from sdpq.integrations import _ds_engine_internals, _ds_zero3_internals, _ds_zero12_internals
    from sdpq.integrations.deepspeed import TESTED_DEEPSPEED

    for mod in (_ds_engine_internals, _ds_zero3_internals, _ds_zero12_internals):
        assert min(mod.CHECKED_DEEPSPEED, key=Version) == TESTED_DEEPSPEED[0], mod.__name__


# ---------------------------------------------------------------------------- process-wide patches


def test_a_process_patch_is_shared_and_put_back_exactly():
    """ProcessPatch: one replacement however many hold it, the original back after the last
    release (a release counts once), an inherited attribute inherited again, and a chain that
    someone else wrapped on top of sdpq's left alone."""
    import types

    from sdpq.integrations._ds_patch import ProcessPatch

    def f(x):
        return x

    mod = types.ModuleType("m")
    mod.f = f
    patch = ProcessPatch(lambda: mod, "f", lambda orig: lambda x: orig(x) + 1)
    first, second = patch.acquire(), patch.acquire()
    assert mod.f(1) == 2 and mod.f.__sdpq_original__ is f and patch.holders == 2 and patch.original is f
    first()
    first()
    assert mod.f(1) == 2 and patch.holders == 1
    second()
    assert mod.f is f and patch.holders == 0 and patch.original is None

    class Base:
        def g(self):
            return 1

    class Child(Base):
        pass

    inherited = ProcessPatch(lambda: Child, "g", lambda orig: lambda self: 2)
    release = inherited.acquire()
    assert Child().g() == 2
    release()
    assert "g" not in vars(Child) and Child().g() == 1

    release = patch.acquire()
    ours = mod.f

    def theirs(x):  # another library's wrapper over sdpq's
        return ours(x) * 10

    mod.f = theirs
    release()
    assert mod.f is theirs and mod.f(1) == 20 and patch.holders == 0


@needs_deepspeed
def test_the_import_hook_is_removable_and_puts_deepspeed_back_exactly():
    """`import sdpq` holds one reference to the initialize wrapper and the engine guard;
    uninstall_deepspeed_hook() releases both (DeepSpeed's own functions are back, the import hook
    is gone) and install_deepspeed_hook() takes them again, once however often it is called."""
    import sys

    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import sdpq.integrations as si
    from sdpq.integrations import _ds_hook

    initialize, engine_init = deepspeed.initialize, DeepSpeedEngine.__dict__["__init__"]
    ds_initialize, ds_engine_init = initialize.__sdpq_original__, engine_init.__sdpq_original__
    try:
        si.uninstall_deepspeed_hook()
        si.uninstall_deepspeed_hook()
        assert deepspeed.initialize is ds_initialize and DeepSpeedEngine.__dict__["__init__"] is ds_engine_init
        assert _ds_hook.INITIALIZE.holders == _ds_hook.ENGINE_GUARD.holders == 0
        assert not any(isinstance(f, _ds_hook._Finder) for f in sys.meta_path)
    finally:
        si.install_deepspeed_hook()
        si.install_deepspeed_hook()
    assert deepspeed.initialize.__sdpq_original__ is ds_initialize
    assert DeepSpeedEngine.__dict__["__init__"].__sdpq_original__ is ds_engine_init
    assert _ds_hook.INITIALIZE.holders == _ds_hook.ENGINE_GUARD.holders == 1


def test_both_adapters_keep_only_what_differs():
    """ZeRO-3's and ZeRO-1/2's adapters are one DeepSpeedAdapterBase: neither writes its own
    install/undo, remove, statistics, checkpoint save/load decision or file validation."""
    from sdpq.comm import stats
    from sdpq.integrations._ds_adapter import DeepSpeedAdapter
    from sdpq.integrations._ds_base import DeepSpeedAdapterBase, engine_stats
    from sdpq.integrations._ds_zero12 import Zero12Adapter

    shared = ("__init__", "patch", "on_remove", "remove", "state_dict", "load_state_dict", "_after_load",
              "_agree", "_schedules_differ", "_incompatible", "_state_path")  # fmt: skip
    for adapter in (DeepSpeedAdapter, Zero12Adapter):
        assert issubclass(adapter, DeepSpeedAdapterBase)
        own = {n for klass in adapter.__mro__[: adapter.__mro__.index(DeepSpeedAdapterBase)] for n in vars(klass)}
        assert own.isdisjoint(shared), (adapter.__name__, sorted(own & set(shared)))
    assert engine_stats in stats._HOLDERS
