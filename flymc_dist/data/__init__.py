from flymc_dist.data.store import *  # noqa: F403 - step 1 of the split (replaced in step 2)
