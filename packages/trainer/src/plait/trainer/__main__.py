"""`python -m plait.trainer ...`: what every rank runs (torchrun, or plait-train --nproc-per-node)."""

import sys

from plait.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
