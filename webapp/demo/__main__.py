"""`python -m webapp.demo`: the whole loop on this machine (see webapp/demo/__init__.py)."""

import sys

from webapp.demo import main

sys.exit(main())
