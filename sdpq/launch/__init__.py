"""Launch helpers (application layer): an emulated multi-node cluster on one Linux machine."""
