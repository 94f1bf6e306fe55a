"""`python -m ddtree.cli`: the `ddtree` command."""

import sys

from ddtree.cli.main import main

sys.exit(main())
