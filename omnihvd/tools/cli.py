"""The ``omnihvd`` command line: ``omnihvd <command> [options]``.

Each command lives in its own module, which provides ``configure_parser(parser)``
and ``run(args) -> int`` (the exit status). Modules are imported only when their
command runs, so ``omnihvd doctor`` works even when torch or horovod is broken.
"""
import argparse
import importlib
import os
import sys

__all__ = ["main", "COMMANDS", "positive"]

# command -> (module, one-line help)
COMMANDS = {
    "doctor": ("omnihvd.tools.doctor", "check the installation: horovod, MPI, torch, mpi4py"),
    "simulate": ("omnihvd.tools.simulate",
                 "rehearse a cluster of n ranks with the real controller"),
    "plot": ("omnihvd.tools.telemetry",
             "render PNG plots (batch sizes, step time vs ideal) from run logs"),
}


def positive(kind, what=None):
    """An argparse ``type``: one finite value of ``kind`` (int or float) > 0, else a
    usage error naming ``what`` (default: the kind).

    >>> positive(int)("3"), positive(float, "number of seconds")("0.5")
    (3, 0.5)
    >>> positive(int)("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a positive int, got '0'
    """
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError("expected a positive %s, got %r"
                                             % (what or kind.__name__, text))
        return value
    return parse


def _load(name):
    return importlib.import_module(COMMANDS[name][0])


def build_parser(command=None):
    parser = argparse.ArgumentParser(
        prog="omnihvd", description="OmniLearn dynamic batching for Horovod.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:  # import only the module that will run
            _load(name).configure_parser(p)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from ..errors import OmniHvdError

    try:
        return int(_load(args.command).run(args) or 0)
    except OmniHvdError as exc:  # bad input: a message, not a traceback
        print("omnihvd %s: %s" % (args.command, exc), file=sys.stderr)
        return 2
    except BrokenPipeError:   # the reader left (omnihvd doctor --json | head): stop quietly,
        # with stdout on /dev/null so that Python's flush at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
