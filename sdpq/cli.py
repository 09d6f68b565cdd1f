"""The ``sdpq`` command line: the demo, benchmarks, config tools and the emulated cluster.

Sub-commands are registered from the modules that implement them, each exposing
``add_arguments(parser)`` and ``run(args) -> list[dict]`` (benchmarks) so this file stays a
thin dispatcher. Imports are lazy: only the chosen sub-command's module is imported, so
``sdpq config --check`` does not pay for torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

__all__ = ["main"]

# name -> (module, help); every module exposes add_arguments(parser) and run(args) -> list[dict].
_BENCHES = {
    "quant": ("sdpq.bench.quant", "throughput of the quantization primitives vs a plain copy"),
    "comm": ("sdpq.bench.comm", "wire bits and time of the collectives vs unquantized ones"),
    "optim": ("sdpq.bench.optim", "optimizer step time and bytes/param vs torch.optim.AdamW"),
    "scaling": ("sdpq.bench.scaling", "time model: predicted TFLOP/s on published clusters vs SDP4Bit"),
    "step": ("sdpq.bench.step", "per-step time split (compute, codec, comm wait, optimizer) vs the bf16 baseline"),
}


# name -> (module, help); every module exposes add_arguments(parser) and main(args) -> int.
_APPS = {
    "cluster": (
        "sdpq.launch.emulated",
        "run a torchrun job on an emulated K-node cluster (network namespaces, shaped link)",
    ),
    "plan": ("sdpq.plan", "per-GPU memory, cross-node bytes and step time of each configuration"),
    "demo": ("sdpq.demo", "the end-to-end demo (4 CPU ranks, 2 simulated nodes)"),
}


def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _run_bench(args: argparse.Namespace) -> int:
    from .bench.report import print_table

    module = importlib.import_module(_BENCHES[args.bench][0])
    records = module.run(args)
    if args.json:
        json.dump(records, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_table(
            records,
            title=getattr(module, "TITLE", f"sdpq bench {args.bench}"),
            columns=getattr(module, "COLUMNS", None),
        )
    return 0


def _run_config(args: argparse.Namespace) -> int:
    from .config import Config, ConfigError, describe

    if args.doc:
        print(describe())
        return 0
    if args.check:
        try:
            cfg = Config.from_deepspeed(args.check)
        except (ConfigError, OSError, json.JSONDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if cfg is None:
            print(f'{args.check}: no "sdpq" block (plain DeepSpeed)')
            return 0
        from .integrations import IncompatibleConfigError
        from .integrations import check_deepspeed_config as check_config

        try:  # the checks sdpq.deepspeed.initialize makes against the rest of the file
            with open(args.check) as f:
                check_config(json.load(f), cfg)
        except IncompatibleConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0
    print(json.dumps(Config().to_dict(), indent=1))
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given `argv`, only the chosen sub-command's module is imported to add its
    arguments (the others get a bare entry), so that e.g. `sdpq config` imports no benchmark,
    launcher or torch.distributed; without `argv` (or for a top-level --help) every module is."""
    argv = argv or []
    chosen = argv[0] if argv and not argv[0].startswith("-") else None
    bench_chosen = argv[1] if chosen == "bench" and len(argv) > 1 and not argv[1].startswith("-") else None

    def full(name: str) -> bool:
        return chosen is None or chosen == name

    parser = argparse.ArgumentParser(prog="sdpq", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measured comparisons against a baseline in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in _BENCHES.items():
        if not _module_available(module):
            continue
        p = bench_sub.add_parser(name, help=help_)
        if full("bench") and bench_chosen in (None, name):
            p.add_argument("--json", action="store_true", help="print a JSON list of records")
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(func=_run_bench)

    _add_apps(sub, full, ("cluster",))
    cfg = sub.add_parser("config", help="print defaults, the option reference, or check a DeepSpeed config")
    cfg.add_argument("--doc", action="store_true", help="markdown reference of every option")
    cfg.add_argument("--check", metavar="DS_CONFIG", help="validate the 'sdpq' block of a DeepSpeed JSON config")
    cfg.set_defaults(func=_run_config)

    chk = sub.add_parser("check", help="the GPU check (or its CPU rehearsal) and the packing of what it needs")
    chk_sub = chk.add_subparsers(dest="check_command", required=True)
    gpu_p = chk_sub.add_parser("gpu", help="exercise the CUDA path and write gpu_report.json / .md")
    pack_p = chk_sub.add_parser("pack", help="build what the GPU machine lacks into one folder and print the command")
    if full("check"):
        from .check import pack as check_pack
        from .check import runner as check_runner

        check_runner.add_arguments(gpu_p)
        gpu_p.set_defaults(func=lambda a: check_runner.exit_code(check_runner.run(a)))
        check_pack.add_arguments(pack_p)
        pack_p.set_defaults(func=check_pack.main)

    _add_apps(sub, full, ("plan", "demo"))
    return parser


def _add_apps(sub, full, names: tuple[str, ...]) -> None:
    """Sub-commands whose module exposes add_arguments(parser) and main(args) -> int (imported
    only when chosen, or for the top-level --help)."""
    for name in names:
        module, help_ = _APPS[name]
        p = sub.add_parser(name, help=help_)
        if full(name):
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
