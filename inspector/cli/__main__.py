"""``python -m inspector.cli``: the ``inspector`` command."""

import sys

from . import main

sys.exit(main())
