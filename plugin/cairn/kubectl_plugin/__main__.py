"""``python -m cairn.kubectl_plugin`` == ``kubectl-cairn``."""

import sys

from cairn.kubectl_plugin import cli

sys.exit(cli.main())
