"""``python -m jupyter_gpushare.daemon``: the node daemon (same options as
``jupyter gpushare daemon``)."""

from __future__ import annotations

import argparse
import sys

from .cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_gpushare.daemon", description="gpushare node daemon"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
