"""`python -m mp_callbacks._candidate_worker REQUEST`: one candidate of
`autotune`'s proof, in a fresh process (see `mp_callbacks._candidate`).
Kept out of the package's imports, so that running it imports it once."""

import sys

from mp_callbacks._candidate import _worker

if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
