"""``elastictrain train|snapshots|plot ...``: thin, so the library is the program.

Only ``train`` and the commands that load tensors (``snapshots show``, ``snapshots export``,
``plot``) import torch, and only once they run: ``--help`` and listing a store stay fast.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import yaml

from elastictrain.core.config_load import load_config
from elastictrain.core.errors import ConfigError, ElastictrainError, PeerLost, one_line, was_logged
from elastictrain.core.excepthook import say_user_error
from elastictrain.core.fatal import marker_path
from elastictrain.core.logs import flush_standard_streams

SNAPSHOT_URL_HELP = "snapshot store: a local path or any fsspec URL (memory://, s3://bucket/run, ...)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except ElastictrainError as exc:
        say_user_error(exc)
        if isinstance(exc, PeerLost):
            _leave_now(exc.exit_code)
        return exc.exit_code


def run() -> NoReturn:
    """The ``elastictrain`` program (its console script and ``python -m elastictrain``): ``main()``, then the end of
    the process without the interpreter's finalization.

    With torch loaded, tearing the interpreter's modules down takes about a second on two cores; every worker pays it
    at every exit, and torchrun waits for its slowest worker before it restarts the group or ends the job. What that
    finalization does that matters is done first: the program's other non-daemon threads are joined and the atexit
    handlers (a library's or the task's) run, then logging and the standard streams are flushed. A bug its session
    has logged, traceback and all (``failures.py``), ends so too, with 1, as Python ends after a traceback: a peer
    waiting in a collective learns of it when this process is gone. Any other exception but SystemExit is a bug no
    session saw: it leaves the normal way, with its traceback. ``main()`` itself never ends the process, so tests and
    scripts call it in-process.
    """
    code: int | str | None
    try:
        code = main()
    except SystemExit as exc:  # fit()'s Preempted (143); argparse's usage error (2, already printed)
        code = exc.code
    except Exception as exc:
        if not was_logged(exc):
            raise
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # private, not in typeshed; as the interpreter does first: the threading atexit hooks (an idle executor's workers are
    # told to stop), then every non-daemon thread joined
    atexit._run_exitfuncs()  # then the atexit handlers; it clears them, so none runs twice
    _leave_now(code)


def _leave_now(code: int) -> NoReturn:
    """End this worker without the interpreter's finalization: the launcher is restarting the group.

    A rank that lost a peer has nothing left to do. ``fit()`` has already closed the snapshots
    and torn down the process group. What remains is Python's finalization with torch loaded,
    about 1 s here, and torchrun waits for it before it restarts anyone. (A launcher's SIGTERM held
    for a preemption snapshot has already ended the process in ``fit()``; this covers the rank the
    launcher has not signalled yet.)
    """
    logging.shutdown()
    flush_standard_streams()
    os._exit(code)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastictrain", description="Fault-tolerant, elastic training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train the task a config names (launch under torchrun/srun for several workers)",
        description="Train with the defaults (conf/default.yaml), a YAML file and key.sub=value overrides.",
    )
    train.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="e.g. train.max_epochs=4 snapshot.durable.url=s3://bkt/run",
    )
    train.set_defaults(run=lambda args: _train(args.config, args.overrides))

    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("url", metavar="URL", help=SNAPSHOT_URL_HELP)
    store.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option, value parsed as YAML (repeatable; dotted keys nest: "
        "client_kwargs.endpoint_url=http://...); s3:// also reads the AWS_* environment",
    )
    store.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--step", type=int, help="the snapshot at this step (default: the newest that verifies)")

    snapshots = commands.add_parser(
        "snapshots",
        help="list, verify, show, export or prune the snapshots under a URL",
        description="Look into a snapshot store without training. Only show and export load tensors.",
    ).add_subparsers(dest="snapshot_command", required=True)
    _command(
        snapshots,
        "list",
        [store],
        "one row per step-* prefix: step, epoch, created, size, world, sizes (no checksums)",
        lambda tools, text, args, found: (tools.list_document(*found), text.render_list),
    )
    _command(
        snapshots,
        "verify",
        [store],
        "read every object and check every checksum; exit 1 if the newest is invalid",
        lambda tools, text, args, found: (tools.verify_document(*found), text.render_verify),
    )
    _command(
        snapshots,
        "show",
        [store, pick],
        "config, progress, attempts and history of one snapshot",
        lambda tools, text, args, found: (tools.show_document(*found, args.step), text.render_show),
    )
    export = _command(
        snapshots,
        "export",
        [store, pick],
        "write one snapshot's model weights as a plain state_dict file",
        lambda tools, text, args, found: (
            tools.export_document(*found, args.step, args.out, args.format, args.newest_or_fail),
            text.render_export,
        ),
    )
    export.add_argument(
        "--newest-or-fail",
        action="store_true",
        help="export the newest snapshot or, if it does not verify, nothing (exit 1) instead of an older one",
    )
    export.add_argument(
        "--out", required=True, metavar="FILE", help="file to write (torch.load(FILE, weights_only=True) reads it)"
    )
    export.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default="torch",
        help="torch (default) or safetensors (needs the safetensors package)",
    )
    prune = _command(
        snapshots,
        "prune",
        [store],
        "delete all but the newest N snapshots (never the newest valid one)",
        lambda tools, text, args, found: (tools.prune_document(*found, args.keep), text.render_prune),
    )
    prune.add_argument("--keep", type=int, required=True, metavar="N", help="how many of the newest snapshots to keep")
    plot = _command(
        commands,
        "plot",
        [store, pick],
        "draw loss and metric curves of a run, restarts marked, as PNG files",
        lambda tools, text, args, found: (tools.plot_document(*found, args.step, args.out), text.render_plot),
    )
    plot.add_argument("--out", default="plots", metavar="DIR", help="directory for the PNG files (default: ./plots)")
    return parser


def _command(commands, name: str, parents: list, summary: str, build: Callable) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name, parents=parents, help=summary, description=summary[0].upper() + summary[1:] + "."
    )
    parser.set_defaults(run=lambda args: _snapshot_command(args, build))
    return parser


def _snapshot_command(args: argparse.Namespace, build: Callable) -> int:
    from elastictrain.cli import snapshot_text, snapshot_tools

    try:
        with _warnings_to_stderr():
            found = snapshot_tools.open_store(args.url, storage_options(args.storage_option))
            document, render = build(snapshot_tools, snapshot_text, args, found)
    except ElastictrainError as exc:
        if args.json:  # a script reading stdout gets JSON for an error too; main() prints the line
            print(json.dumps({"error": str(exc), "exit_code": exc.exit_code}), flush=True)
        raise
    try:
        print(
            json.dumps(strict_json(document), indent=2, allow_nan=False) if args.json else render(document), flush=True
        )
    except BrokenPipeError:  # `elastictrain snapshots show URL | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush stays quiet
        return 0
    if document.get("newest_valid") is False:  # verify: the newest snapshot does not verify
        print(
            f"elastictrain: error: the newest snapshot under {args.url} (step {document['newest_step']}) is invalid",
            file=sys.stderr,
        )
        return 1
    return 0


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as None: JSON has no NaN or Infinity, and strict parsers (jq, JavaScript,
    Go) reject Python's spelling of them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` strings as fsspec options: values parsed as YAML, dotted keys nested."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {pair!r} is not KEY=VALUE (e.g. --storage-option anon=true)")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--storage-option {key}: value {text!r} is not valid YAML ({one_line(exc)})") from None
        *parents, leaf = key.strip().split(".")
        node = options
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--storage-option {key}: '{part}' is already set to a value, not a mapping")
        node[leaf] = value
    return options


@contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """While a snapshot command runs, library warnings (a skipped snapshot) print as one CLI line."""
    logger = logging.getLogger("elastictrain")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("elastictrain: warning: %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _train(config_path: str | None, overrides: list[str]) -> int:
    # A later attempt after an error no restart can fix has already stopped on `import elastictrain` (fatal.py).
    try:
        cfg = load_config(config_path, overrides)  # before torch is imported: a config error answers at once
        from elastictrain.train.trainer import Trainer

        trainer = Trainer.from_config(cfg)
    except ConfigError as exc:
        # Before the Trainer exists; under torchrun every restart would fail the same way. Where
        # torchrun's run directory can hold the marker (fatal.py), main()'s say_user_error records it:
        # no store, no torch.
        if marker_path() is None:
            from elastictrain.dist.group import stop_repeating

            stop_repeating(exc)
        raise
    summary = trainer.fit()
    return 0 if summary is not None else 1


if __name__ == "__main__":
    run()
