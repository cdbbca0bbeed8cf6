"""`python -m cairn.devcluster.agent`: run the node agent (see `main`)."""

import sys

from cairn.devcluster.agent import main

sys.exit(main.main())
