"""The ``honing`` command.

    honing train [CONFIG.yaml] [section.key=value ...] [--output-dir DIR] [--resume auto|never|PATH]
                 [--max-restarts N]
    honing checkpoints RUN_DIR
    honing serve verifier [--host H] [--port P] [--workers N] [--token T] [...]
    honing serve reward-model --model PATH [--host H] [--port P] [--token T] [...]
    honing serve rollout --model PATH [--host H] [--port P] [--token T] [...]
    honing doctor [CONFIG.yaml] [section.key=value ...] [--output-dir DIR]
    honing report RUN_DIR
    honing eval [CONFIG.yaml] [section.key=value ...] --model PATH [--output FILE]
    honing scale RUN_DIR [--rollout-workers N] [--reward-workers N] [--address auto|HOST:PORT]

A ``UserError`` (bad config, data or input) prints one line and exits with status 2; nothing is
written to the run directory before the config, the data and the model have loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from honing.errors import ProcessLost, RunStopped, Terminated, UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="honing",
        description="Train language models with reinforcement learning from verifiable rewards.",
    )
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
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="run training as a child process and restart it from the newest checkpoint "
        "after a crash, up to N times",
    )
    versions = commands.add_parser(
        "checkpoints", help="list a run's saved checkpoints with their metrics and health"
    )
    versions.add_argument("run_dir", help="the --output-dir of a 'honing train' run")
    doctor = commands.add_parser(
        "doctor", help="check every configured part and run one step (nothing is written)"
    )
    doctor.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    doctor.add_argument(
        "--output-dir", type=Path, default=Path("runs"), help="where checkpoints would go"
    )
    evaluate = commands.add_parser(
        "eval", help="validation accuracy and pass@k of a model or checkpoint, as a run measures it"
    )
    evaluate.add_argument("args", nargs="*", metavar="CONFIG.yaml | section.key=value")
    evaluate.add_argument(
        "--model", required=True, help="a model directory, a run's checkpoint, or a LoRA one"
    )
    evaluate.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    report = commands.add_parser(
        "report", help="write RUN_DIR/report.html: charts of the run's signals and its event log"
    )
    report.add_argument("run_dir", help="the --output-dir of a 'honing train' run")
    scale = commands.add_parser(
        "scale", help="change the Ray workers of a run while it trains (pipeline.backend=ray)"
    )
    scale.add_argument("run_dir", help="the --output-dir of the running 'honing train'")
    scale.add_argument("--rollout-workers", type=int, default=None)
    scale.add_argument("--reward-workers", type=int, default=None)
    scale.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    _add_serve(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from honing.services.options import add_serve_options

    add_serve_options(commands)


def run_serve(ns: argparse.Namespace) -> int:
    """Check the options, take the port, then build the app (which may load a model) and
    serve it until Ctrl-C or SIGTERM."""
    from honing.services.options import check_ranges
    from honing.services.server import ServerLimits, listen, reserve_open_files, serve

    check_ranges(ns)
    limits = ServerLimits(ns.header_timeout_s, ns.max_connections, ns.keep_alive_s)
    reserve_open_files(limits.max_connections)
    sockets = listen(ns.host, ns.port)
    try:
        if ns.service == "rollout":
            app, path = _rollout_app(ns), "/v1/completions"
        else:
            app, path = _scoring_app(ns), "/score"
        if ns.host not in ("127.0.0.1", "localhost", "::1") and not ns.token:
            print(f"honing: warning: serving on {ns.host} without --token", file=sys.stderr)
        port = sockets[0].getsockname()[1]
        print(f"honing {ns.service}: http://{ns.host}:{port}{path}", file=sys.stderr, flush=True)
        serve(app, sockets, limits)
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _rollout_app(ns: argparse.Namespace):
    from honing.config import build_config
    from honing.host import configure_host
    from honing.models.loading import load_causal_lm, load_tokenizer, resolve_device
    from honing.pipeline.components import resolve_model_path
    from honing.rollout.native.engine import TransformersEngine
    from honing.services.options import CompletionLimits
    from honing.services.rollout import rollout_app

    configure_host(ns.threads)
    config = build_config({"model.path": ns.model})
    path = resolve_model_path(config, log=lambda message: print(message, file=sys.stderr))
    device = resolve_device(ns.device)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, tokenizer, dtype=ns.dtype, device=device)
    speculation = None
    if ns.speculative != "off":
        from honing.pipeline.rollout_engines import speculation as build_speculation

        settings = {"rollout.speculative": ns.speculative, "rollout.spec_tokens": ns.spec_tokens}
        settings |= {"rollout.spec_draft": ns.spec_draft, "model.dtype": ns.dtype}
        speculation = build_speculation(build_config(settings), tokenizer, device, model)
    engine = TransformersEngine(model.eval(), tokenizer, device=device, speculation=speculation)
    return rollout_app(
        engine,
        model_name=ns.name or ns.model,
        limits=CompletionLimits(ns.max_seq_len, ns.max_tokens, ns.max_sequences),
        token=ns.token,
        exit_after=ns.exit_after,
    )


def _scoring_app(ns: argparse.Namespace):
    guards = {
        "token": ns.token,
        "max_concurrency": ns.max_concurrency,
        "max_queue": ns.max_queue,
        "max_body_bytes": int(ns.max_body_mb * (1 << 20)),
    }
    if ns.service == "verifier":
        from honing.services.verifier import verifier_app

        routes = dict(item.split("=", 1) for item in ns.route if "=" in item)
        if len(routes) != len(ns.route):
            raise UserError(f"--route expects DATA_SOURCE=SPEC, got {ns.route}")
        app = verifier_app(
            workers=ns.workers,
            function=ns.function,
            routes=routes,
            math_timeout_s=ns.math_timeout_s,
            code_timeout_s=ns.code_timeout_s,
            delay_s=ns.delay_ms / 1000,
            **guards,
        )
    else:
        from honing.services.reward_model import reward_model_app

        app = reward_model_app(
            ns.model,
            device=ns.device,
            max_batch=ns.max_batch,
            max_wait_ms=ns.max_wait_ms,
            max_length=ns.max_length,
            **guards,
        )
    return app


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
    from honing.backends.launch import train
    from honing.pipeline.run import after_stop, default_output_dir

    run_dir = ns.output_dir or default_output_dir(config_path)
    ns.after_stop = lambda: after_stop(config, run_dir)  # the last line of a stopped run
    info = train(config, run_dir, resume=ns.resume)
    if not info:  # a data-parallel rank other than 0: rank 0 reports
        return 0
    print(f"run: {run_dir}")
    for line in closing_lines(info):
        print(line)
    return 0


def closing_lines(info: dict) -> list[str]:
    """The validation of a finished run (``pipeline.run.summary``): first -> last, with the
    change in points; a run validated once gets its one figure, no change claimed."""
    lines = []
    if "val_accuracy_start" in info:
        start, end = info["val_accuracy_start"], info["val_accuracy_end"]
        first, last, seconds = info["first_step"], info["last_step"], info["seconds"]
        key = info["pass_at_k_key"]
        if first == last:
            lines.append(f"val/accuracy: {end:.3f} at step {last} ({seconds:.0f} s)")
            if key:
                lines.append(f"{key}: {info['pass_at_k_end']:.3f}")
        else:
            lines.append(
                f"val/accuracy: {start:.3f} at step {first} -> {end:.3f} at step {last} "
                f"({100 * (end - start):+.1f} points, {seconds:.0f} s)"
            )
            if key:
                lines.append(f"{key}: {info['pass_at_k_start']:.3f} -> {info['pass_at_k_end']:.3f}")
    if info.get("val_score_errors"):
        lines.append(
            f"val/score_errors: {info['val_score_errors']} validation scores failed on every "
            "try and were left out of the rates (events.jsonl: val_score_errors)"
        )
    return lines


def run_eval(ns: argparse.Namespace) -> int:
    import json

    from honing.config import resolve_config
    from honing.pipeline.evaluate import evaluate_model

    config_path, overrides = _split_args(ns.args)
    config = resolve_config(config_path, overrides)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    metrics = evaluate_model(config, ns.model, log=log)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if key != "val/prompts" else f"{key}: {value:.0f}")
    if ns.output is not None:
        ns.output.write_text(json.dumps({"model": ns.model, **metrics}, indent=1))
    return 0


def run_scale(ns: argparse.Namespace) -> int:
    if ns.rollout_workers is None and ns.reward_workers is None:
        raise UserError("give --rollout-workers N and/or --reward-workers N")
    if ns.rollout_workers is not None and ns.rollout_workers < 1:
        raise UserError(f"--rollout-workers: expected >= 1, got {ns.rollout_workers}")
    if ns.reward_workers is not None and ns.reward_workers < 0:
        raise UserError(f"--reward-workers: expected >= 0, got {ns.reward_workers}")
    from honing.backends.ray_run import scale

    targets = scale(ns.run_dir, ns.rollout_workers, ns.reward_workers, address=ns.address)
    print(" ".join(f"{key}={value}" for key, value in targets.items()))
    return 0


def run_doctor(ns: argparse.Namespace) -> int:
    from honing.config import resolve_config
    from honing.pipeline.doctor import format_checks, run_doctor

    config_path, overrides = _split_args(ns.args)
    config = resolve_config(config_path, overrides)
    checks = run_doctor(config, ns.output_dir)
    print(format_checks(checks))
    return 1 if any(c.status == "failed" for c in checks) else 0


def _supervised(argv: list[str] | None, max_restarts: int) -> int:
    """``honing train ... --max-restarts N``: the same command as a supervised child."""
    from honing.pipeline.supervise import supervise, without_option

    if max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {max_restarts}")
    raw = list(argv if argv is not None else sys.argv[1:])
    args = without_option(raw[raw.index("train") + 1 :], "--max-restarts")
    return supervise(
        args, max_restarts, log=lambda message: print(f"honing: {message}", file=sys.stderr)
    )


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within it, the first SIGTERM raises ``Terminated`` in the main thread (handled as Ctrl-C
    is) and a second one kills at once, as SIGTERM does by default; the handler before it is
    put back after."""

    def handler(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = _parser()
    # Overrides may come after the options too: `train cfg.yaml --output-dir d key=value`.
    ns, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and ns.command not in ("train", "doctor", "eval")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    try:
        if ns.command == "serve":
            return run_serve(ns)
        if ns.command == "checkpoints":
            from honing.checkpoint.versions import format_checkpoints, list_checkpoints

            if not Path(ns.run_dir).is_dir():
                raise UserError(f"{ns.run_dir}: no such run directory")
            print(format_checkpoints(list_checkpoints(ns.run_dir)))
            return 0
        if ns.command == "train" and ns.max_restarts:
            return _supervised(argv, ns.max_restarts)
        if ns.command == "scale":
            return run_scale(ns)
        if ns.command == "report":
            from honing.monitor.report import report_main

            return report_main(ns.run_dir)
        ns.args = ns.args + extra
        run = {"doctor": run_doctor, "eval": run_eval, "train": run_train}[ns.command]
        with stop_on_sigterm():
            return run(ns)
    except UserError as err:
        # one write: torchrun's ranks share stderr, and lines written in two parts interleave
        sys.stderr.write(f"honing: error: {err}\n")
        sys.stderr.flush()
        return 2
    except (RunStopped, ProcessLost) as stop:
        print(f"honing: {stop}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt as stop:
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        after_stop = getattr(ns, "after_stop", None)  # set by run_train once the config is read
        if after_stop is not None:
            then = after_stop()
        else:
            then = "resume with --resume auto" if ns.command == "train" else "run it again"
        print(f"honing: {how}; {then}", file=sys.stderr)
        return stop.exit_status if isinstance(stop, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
