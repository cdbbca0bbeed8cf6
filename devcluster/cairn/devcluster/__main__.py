"""`python -m cairn.devcluster`: the same as the `devcluster` command."""

import sys

from cairn.devcluster import cli

sys.exit(cli.main())
