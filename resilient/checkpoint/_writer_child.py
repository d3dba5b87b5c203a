"""Entry point of the checkpoint writer process (see ``procwriter.py``); not imported by the package."""

import sys
from multiprocessing.connection import Connection

from resilient.checkpoint.procwriter import child_main

if __name__ == "__main__":
    fd, arena = sys.argv[1:3]
    child_main(Connection(int(fd)), arena)
