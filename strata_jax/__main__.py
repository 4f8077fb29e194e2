"""`python -m strata_jax`: the `strata-jax` command (see strata_jax/cli/).

With no subcommand it runs the demo: one prompt through a scaled-down preset with every expert
resident, stream-all and routed, each arm's summary, and whether logits and KV cache are the same
bytes in every arm. Needs no GPU and no files.
"""

import sys

from strata_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
