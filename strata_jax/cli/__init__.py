"""The `strata-jax` command (also `python -m strata_jax`): `main` and the commands' table.

One module per part (options.DESCRIPTION is the command's --help: subcommands, model options,
exit codes):

  options   the argument parser: option types, option groups, build_parser
  common    what several commands share: UsageError, _Log, the model (_Model, model_config,
            read_prompt_file, random_prompt), backend and device, prompts, the profile, the
            stream config, making the engine, JSON
  checks    the refusals before any work: resident/ring budgets, a prefill's memory plan
  prefill   cmd_prefill         profile   cmd_profile, hottest
  info      cmd_info            demo      cmd_demo
  score     cmd_score

The memory estimates themselves are strata_jax/engine/memory.py's (memory_plan is re-exported here).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence

from tqdm.auto import tqdm

from strata_jax.cli.common import (SCALES, UsageError, _Log, model_config, random_prompt,
                                   read_prompt_file)
from strata_jax.cli.demo import cmd_demo
from strata_jax.cli.info import cmd_info
from strata_jax.cli.options import PROG, build_parser
# _per_layer_rows, hottest and memory_plan: the tests reach them as cli.<name>.
from strata_jax.cli.prefill import _per_layer_rows, cmd_prefill  # noqa: F401
from strata_jax.cli.profile import cmd_profile, hottest  # noqa: F401
from strata_jax.cli.score import cmd_score
from strata_jax.engine.memory import memory_plan  # noqa: F401

__all__ = ["SCALES", "UsageError", "main", "memory_plan", "model_config", "read_prompt_file"]


_COMMANDS = {"demo": cmd_demo, "prefill": cmd_prefill, "score": cmd_score,
             "profile": cmd_profile, "info": cmd_info}


# Exit code when the reader of stdout closed it early (`strata-jax prefill ... | head -2`): 128 +
# SIGPIPE, what a shell reports for a program the signal ended (as 130 is 128 + SIGINT).
EXIT_STDOUT_CLOSED = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (see options.DESCRIPTION). A reader that
    closes stdout early (`| head`) ends the command quietly: no traceback, exit code 141."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that closed early shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_STDOUT_CLOSED


def _stdout_to_devnull() -> None:
    """Points stdout's file descriptor at /dev/null, so what Python still flushes at exit
    goes nowhere instead of raising BrokenPipeError again (Python's documented way: the
    signal module's "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout with no descriptor (io.StringIO)
        pass


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["demo", *argv]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2)
        return int(e.code or 0)
    log = _Log(getattr(args, "quiet", False))

    def show(message, category, filename, lineno, file=None, line=None):
        # One line, not the source location and code line Python adds; through tqdm so that
        # a progress bar on stderr is redrawn below it.
        tqdm.write(f"{PROG} {args.command}: warning: {' '.join(str(message).split())}",
                   file=sys.stderr)

    try:
        with warnings.catch_warnings():
            if log.quiet:  # -q: the library's warnings too (errors still print below)
                warnings.simplefilter("ignore")
            else:
                warnings.showwarning = show
            return _COMMANDS[args.command](args, log)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # the engine or the device failed: not bad input, still one line
        print(f"{PROG} {args.command}: failed: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
