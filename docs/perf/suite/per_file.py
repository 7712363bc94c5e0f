"""Per-file seconds of the suite from pytest's JUnit XML files (each test's setup + call + teardown, pytest's
default `junit_duration_report`), side by side:
    python docs/perf/suite/per_file.py BEFORE.xml AFTER.xml [--names before after]
Under pytest-xdist two workers run at once, so a file's seconds are its tests' own time, not the wall clock's
share; the suite's wall time is `make test`'s."""

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_file(path: str) -> tuple[dict[str, float], dict[str, int]]:
    seconds, tests = defaultdict(float), defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").split("::")[0]
        file = name.replace(".", "/") + ".py" if not name.endswith(".py") else name
        seconds[file] += float(case.get("time", 0.0))
        tests[file] += 1
    return seconds, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("xml", nargs="+")
    parser.add_argument("--names", nargs="+")
    args = parser.parse_args()
    names = args.names or [f"run {i + 1}" for i in range(len(args.xml))]
    runs = [per_file(path) for path in args.xml]
    files = sorted({f for seconds, _ in runs for f in seconds}, key=lambda f: -max(s.get(f, 0.0) for s, _ in runs))
    print("| file | " + " | ".join(f"{n}: tests, s" for n in names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for f in files:
        cells = [f"{t.get(f, 0)}, {s.get(f, 0.0):.1f}" for s, t in runs]
        print(f"| {f} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{sum(t.values())}, {sum(s.values()):.1f}" for s, t in runs) + " |")


if __name__ == "__main__":
    main()
