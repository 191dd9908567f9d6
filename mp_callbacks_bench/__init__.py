"""The benchmark application of mp_callbacks: `mp-callbacks bench` and
`mp-callbacks doctor`, and `run_bench` for notebooks.

Kept apart from the library (`mp_callbacks`), which training code imports:
this package holds the command line, the benchmark runs, their data, the
reference models and the report formatting. Importing it is cheap; the
library and TensorFlow are imported when a benchmark runs.
"""

from mp_callbacks_bench.api import BenchReport, run_bench
from mp_callbacks_bench.settings import BenchError, BenchSettings

__all__ = ["BenchError", "BenchReport", "BenchSettings", "run_bench"]
