"""``elastictrain train --config FILE key=value ...``: thin, so the library is the program."""

from __future__ import annotations

import argparse
import sys

from .config import load_config
from .errors import ElastictrainError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastictrain", description="Fault-tolerant, elastic training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train the task a config names (launch under torchrun/srun for several workers)",
        description="Train with the defaults (conf/default.yaml), a YAML file and key.sub=value overrides.",
    )
    train.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    train.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. train.max_epochs=4 snapshot.url=s3://bkt/run")
    args = parser.parse_args(argv)
    try:
        return _train(args.config, args.overrides)
    except ElastictrainError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _train(config_path: str | None, overrides: list[str]) -> int:
    # Imported here so `elastictrain --help` and config errors do not wait for torch.
    from .loop import Trainer

    summary = Trainer.from_config(load_config(config_path, overrides)).fit()
    return 0 if summary is not None else 1


if __name__ == "__main__":
    sys.exit(main())
