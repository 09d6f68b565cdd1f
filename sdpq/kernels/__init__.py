"""Compiled kernels and the dispatch to them: C++ on CPU (``sdpq/csrc``, built at first use),
Triton on CUDA, each tested against the PyTorch reference in ``sdpq.quant``.

The collectives (``sdpq.comm``) call the codec's hot paths from here; ``sdpq.optim`` calls the
AdamW and finite-check operators (``adamw_ops``, ``finite_ops``). Each falls back to the
reference where its kernel cannot run (no C++ compiler, ``SDPQ_CPP=0``, ``SDPQ_TRITON=0``).
"""

from .dispatch import decode_rows, decode_rows_inverse_hadamard, encode_rows, reduce_rows, uses_cpp, uses_triton

__all__ = ["encode_rows", "decode_rows", "reduce_rows", "decode_rows_inverse_hadamard", "uses_triton", "uses_cpp"]
