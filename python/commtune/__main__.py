"""Command line: `python -m commtune demo [--iterations N] [--warmup N] [--ranks N]`, `python -m commtune bench allreduce ...`,
`python -m commtune bench plan|scaling|wire ...`, `python -m commtune tune nccl ...`."""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m commtune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model with each hook and print the counters "
                                       "(GPUs + NCCL when present, else 2 CPU ranks on gloo)")
    demo.add_argument("--iterations", type=int, default=20, help="iterations per hook (default 20)")
    demo.add_argument("--warmup", type=int, default=3,
                      help="iterations per hook before the timing and the counters start (default 3)")
    demo.add_argument("--ranks", type=int, default=None,
                      help="number of ranks (default: every GPU, or 2 CPU ranks)")
    bench = sub.add_parser("bench", help="benchmarks: `bench allreduce|plan|scaling|wire [options]` (see --help there)")
    bench.add_argument("name", choices=["allreduce", "plan", "scaling", "wire"])
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark")
    tune = sub.add_parser("tune", help="`tune nccl [options]`: measured NCCL settings for a model's buckets")
    tune.add_argument("what", choices=["nccl"])
    tune.add_argument("options", nargs=argparse.REMAINDER, help="passed to the tuner (see tune nccl --help)")
    args = parser.parse_args(argv)
    if args.command == "tune":
        from . import tune as tune_mod

        tune_mod.main(args.options)
        return 0
    if args.command == "bench":
        from .bench import allreduce_sweep, plan, scaling, wire

        {"allreduce": allreduce_sweep, "plan": plan, "scaling": scaling, "wire": wire}[args.name].main(args.options)
        return 0
    if args.command == "demo":
        if args.iterations < 1:
            parser.error("--iterations must be at least 1")
        if args.warmup < 0:
            parser.error("--warmup must be at least 0")
        if args.ranks is not None and args.ranks < 1:
            parser.error("--ranks must be at least 1")
        from . import demo as demo_mod

        demo_mod.main(iterations=args.iterations, world_size=args.ranks, warmup=args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
