"""``python -m nopecache.cache_server``: the same as the ``nopecache-server`` command."""

from __future__ import annotations

import sys

from nopecache.cache_server.main import main

sys.exit(main())
