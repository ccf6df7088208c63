"""``python -m flymc_dist.cli``: the ``flymc`` command."""

import sys

from flymc_dist.cli import main

sys.exit(main())
