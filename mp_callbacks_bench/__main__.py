"""`python -m mp_callbacks_bench` is `mp-callbacks`."""

import sys

from mp_callbacks_bench.cli import main

sys.exit(main())
