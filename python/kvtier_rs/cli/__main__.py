"""`python -m kvtier_rs.cli`: the `kvtier` command."""

import sys

from kvtier_rs.cli import main

sys.exit(main())
