"""`python -m adaptmem.demo [modes] [options]`."""

from __future__ import annotations

import sys

from adaptmem.demo import finetune, table


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["modes"]:
        return table.main(args[1:])
    return finetune.main(args)


if __name__ == "__main__":
    sys.exit(main())
