"""``python -m sdpq``: the ``sdpq`` command line."""

from .cli import main

raise SystemExit(main())
