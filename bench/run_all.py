"""``make bench``: every benchmark script, results under bench/results/ (JSON + Markdown)."""

import sys

from bench import planning_time, reference_runs


def main() -> int:
    rc = 0
    for mod in (planning_time, reference_runs):
        print(f"== {mod.__name__}")
        rc |= mod.main()
    return rc


if __name__ == "__main__":
    sys.exit(main())
