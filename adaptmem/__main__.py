"""`python -m adaptmem report run.jsonl [--out run.png]`."""

from __future__ import annotations

import sys

from adaptmem import report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] != ["report"]:
        print("usage: python -m adaptmem report run.jsonl [--out run.png] [--run RUN_ID]", file=sys.stderr)
        return 2
    return report.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
