"""Command-line options shared by the two Fashion-MNIST examples (Horovod and DDP).

Kept apart so that the DDP example needs no Horovod import.
"""
import argparse

MODES = ("omnihvd", "plain", "fixed")


def parse_args(description):
    """Parse and check the examples' options (``--mode``, ``--split``, ``--steps``, ...)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--limit", type=int, default=None, help="use only the first N training images")
    p.add_argument("--steps", type=int, default=None,
                   help="epochs of this many steps (the first steps*global-batch-size images)")
    p.add_argument("--mode", choices=MODES, default="omnihvd")
    p.add_argument("--split", default=None, help="--mode fixed: per-rank sizes, e.g. 128,64,64")
    p.add_argument("--slowdown", default=None, help="per-rank slowdown factors, e.g. 1,1,2,4")
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args()
    if args.steps is not None:
        args.limit = args.steps * args.global_batch_size
    if (args.mode == "fixed") != (args.split is not None):
        p.error("--split goes with --mode fixed, and --mode fixed needs --split")
    if args.checkpoint and args.mode == "plain":
        p.error("--checkpoint needs omnihvd's sampler (--mode omnihvd or fixed) to resume "
                "mid-training")
    if args.split is not None:
        args.split = [int(s) for s in args.split.split(",")]
    return args
