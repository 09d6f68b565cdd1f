"""The release of sdpq (the one definition: pyproject.toml reads it, ranks compare it at set-up)."""

__version__ = "0.1.0"
