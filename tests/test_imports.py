"""The first lines users type: the submodules import every way, `python -m sdpq` runs, and
`import sdpq` alone imports neither torch.distributed's frameworks nor DeepSpeed."""

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_import_sdpq_imports_no_framework():
    out = _python("import sys, sdpq; print('deepspeed' in sys.modules, 'torch' in sys.modules, "
                  "'transformers' in sys.modules)")
    assert out.split() == ["False", "False", "False"]


def test_fsdp_submodule_every_way():
    out = _python("import sdpq.fsdp\nfrom sdpq.fsdp import apply, state_dict\nimport sdpq\n"
                  "print(sdpq.fsdp.apply is apply, sdpq.fsdp.state_dict is state_dict)")
    assert out.split() == ["True", "True"]


def test_deepspeed_submodule_every_way():
    pytest.importorskip("deepspeed")
    out = _python("import sdpq.deepspeed\nfrom sdpq.deepspeed import initialize\nimport sdpq\n"
                  "print(sdpq.deepspeed.initialize is initialize)")
    assert out.split()[-1] == "True"


def test_attribute_access_imports_on_demand():
    out = _python("import sdpq\nprint(sdpq.fsdp.__name__, callable(sdpq.fsdp.apply))")
    assert out.split() == ["sdpq.fsdp", "True"]


def test_python_dash_m_sdpq():
    out = subprocess.run([sys.executable, "-m", "sdpq", "--help"], check=True, capture_output=True, text=True,
                         timeout=120).stdout
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
    path.write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, '
                    '"sdpq": {"weights": {}}}')
    out = _python(f"import sys\nfrom sdpq.cli import main\nassert main(['config', '--check', {str(path)!r}]) == 0\n"
                  "print('RESULT', 'torch.distributed' in sys.modules, any(m.startswith('sdpq.bench.') for m in sys.modules))")
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
    torch_pin = next(d for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.startswith("torch"))
    oldest = tuple(int(x) for x in CHECKED_TORCH[0].split(".")[:2])
    assert torch_pin == f"torch>={oldest[0]}.{oldest[1]}"
    assert f"**Tested torch versions: {', '.join(CHECKED_TORCH)}**" in (root / "README.md").read_text()
