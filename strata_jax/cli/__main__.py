"""`python -m strata_jax.cli`, the same as `python -m strata_jax`."""

import sys

from strata_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
