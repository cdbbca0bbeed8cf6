"""`python -m cairn.trainer.raydriver`: see `cairn.trainer.raydriver.cli`."""

import sys

from cairn.trainer.raydriver import cli

sys.exit(cli.main())
