"""``python -m flymc_dist.cli``: the ``flymc`` command."""

import sys

from flymc_dist.cli import main

# guarded: Dask's worker processes (spawn) import the main module again, and must not
# run the command again in each
if __name__ == "__main__":
    sys.exit(main())
