"""The ``honing`` command.

    honing train [CONFIG.yaml] [section.key=value ...] [--output-dir DIR] [--resume auto|never|PATH]

A ``UserError`` (bad config, data or input) prints one line and exits with status 2; nothing is
written to the run directory before the config, the data and the model have loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from honing.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="honing", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a policy with RL from verifiable rewards")
    train.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG.yaml | section.key=value",
        help="an optional YAML config, then dotted overrides",
    )
    train.add_argument(
        "--output-dir", type=Path, default=None, help="run directory (default runs/<config>-<time>)"
    )
    train.add_argument(
        "--resume",
        default="auto",
        help="auto (newest complete checkpoint in the run directory), never, "
        "or a checkpoint directory",
    )
    return parser


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first positional may be a YAML file; the rest are key=value overrides."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        raise UserError(
            f"unexpected argument {bad[0]!r}: expected section.key=value "
            "(only the first argument may be a config file)"
        )
    return None, args


def run_train(ns: argparse.Namespace) -> int:
    from honing.config import resolve_config

    config_path, overrides = _split_args(ns.args)
    config = resolve_config(config_path, overrides)
    from honing.pipeline.run import default_output_dir, train

    run_dir = ns.output_dir or default_output_dir(config_path)
    info = train(config, run_dir, resume=ns.resume)
    print(f"run: {run_dir}")
    if "val_accuracy_start" in info:
        start, end = info["val_accuracy_start"], info["val_accuracy_end"]
        print(
            f"val/accuracy: {start:.3f} at step {info['first_step']} -> {end:.3f} at step "
            f"{info['last_step']} ({100 * (end - start):+.1f} points, "
            f"{info['seconds']:.0f} s)"
        )
        if info["pass_at_k_key"]:
            print(
                f"{info['pass_at_k_key']}: {info['pass_at_k_start']:.3f} -> "
                f"{info['pass_at_k_end']:.3f}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _parser()
    # Overrides may come after the options too: `train cfg.yaml --output-dir d key=value`.
    ns, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ns.args = ns.args + extra
    try:
        return run_train(ns)
    except UserError as err:
        print(f"honing: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("honing: interrupted; resume with --resume auto", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
