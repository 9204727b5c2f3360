"""`python -m plait.trainer ...` and `plait-train ...`: what every rank runs (torchrun, or
plait-train --nproc-per-node)."""

import sys

from plait.trainer.cli import main


def run() -> None:
    code = main()
    if code:
        from plait.trainer.exit_codes import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
