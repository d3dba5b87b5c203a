"""``chaos`` command line: lists the injectors and checks a fault plan."""

from __future__ import annotations

import argparse

from chaos.inject import KINDS, Injector


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chaos", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("kinds", help="list the fault kinds")
    chk = sub.add_parser("check", help="parse a fault plan (kind@step[:rank][=arg][xN],...)")
    chk.add_argument("plan")
    args = p.parse_args(argv)
    if args.cmd == "kinds":
        print("\n".join(KINDS))
    else:
        for f in Injector.parse(args.plan).faults:
            print(f)
    return 0
