"""docs/api.md lists exactly what the public modules export (see tests/api_doc.py)."""

from pathlib import Path

import pytest

import api_doc


def test_api_page_matches_the_code():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    committed = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    assert committed == api_doc.render(), "regenerate: .venv/bin/python tests/api_doc.py > docs/api.md"
