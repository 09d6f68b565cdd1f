"""docs/api.md lists exactly what the public modules export (see tests/api_doc.py)."""

from pathlib import Path

import api_doc
import pytest


def test_api_page_matches_the_code():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    pytest.importorskip("torchft")  # sdpq.torchft wraps torchft's ProcessGroup class
    committed = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    assert committed == api_doc.render(), "regenerate: .venv/bin/python tests/api_doc.py > docs/api.md"


def test_the_front_door_is_sdpq_all():
    """docs/api.md's "Start here" enters every name of sdpq.__all__ and names only calls that exist."""
    assert api_doc.front_door_gaps() == []


def test_mark_weights_changed_goes_to_the_integration_that_built_the_target():
    import types

    import sdpq

    with pytest.raises(TypeError, match="object has no sdpq weight gathers"):
        sdpq.mark_weights_changed(object())
    pytest.importorskip("deepspeed")
    from sdpq.integrations._ds_adapter import DeepSpeedAdapter

    calls = []

    class Adapter(DeepSpeedAdapter):
        def __init__(self):  # no engine: only the call is looked at
            pass

        def mark_weights_changed(self, params=None, *, exact=True):
            calls.append(exact)

    engine = types.SimpleNamespace(sdpq=Adapter())
    sdpq.mark_weights_changed(engine)
    sdpq.mark_weights_changed(engine, exact=False)
    assert calls == [True, False]
