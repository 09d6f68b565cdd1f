"""Benchmarks behind ``sdpq bench``: each module measures sdpq next to a baseline in the same run."""
