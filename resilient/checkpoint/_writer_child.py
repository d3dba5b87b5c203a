"""Entry point of the checkpoint writer process (see ``procwriter.py``); not imported by the package."""

import sys
from multiprocessing.connection import Connection

from resilient.checkpoint.procwriter import child_main

if __name__ == "__main__":
    fd, arena, root, rank, world, token, keep = sys.argv[1:8]
    child_main(Connection(int(fd)), arena, root, int(rank), int(world), token, int(keep))
