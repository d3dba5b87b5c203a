"""A worker that runs for --run-s seconds (its workload) and then exits 75 in its first N launch
attempts and 0 after: failures spaced in time, as in a long job that fails now and then."""

import os
import sys
import time

fail_first, run_s = int(sys.argv[1]), float(sys.argv[2])
time.sleep(run_s)  # the workload (this worker has nothing else to do)
sys.exit(75 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < fail_first else 0)
