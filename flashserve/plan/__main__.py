"""``python -m flashserve.plan``."""

import sys

from .cli import main

sys.exit(main())
