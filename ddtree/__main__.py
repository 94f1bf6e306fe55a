"""`python -m ddtree`: the `ddtree` command."""

import sys

from ddtree.cli.main import main

sys.exit(main())
