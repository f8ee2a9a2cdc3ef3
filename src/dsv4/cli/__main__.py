"""``python -m dsv4.cli``: the ``dsv4`` command."""

import sys

from . import main

sys.exit(main())
