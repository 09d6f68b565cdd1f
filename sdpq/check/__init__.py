"""`sdpq check gpu`: one command that exercises sdpq's CUDA path on a GPU machine and writes a
report (`gpu_report.json`, `gpu_report.md`), and `sdpq check pack`, which builds what that
machine lacks into one folder to carry there. `--rehearse` runs the same steps on the CPU
(Triton's interpreter, small sizes) so the check cannot rot between the rare GPU runs.

See docs/gpu_check.md.
"""
