"""README.md: its reading-order line counts, its example log and its size say what the repository holds."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_reading_order_line_counts_are_the_files():
    """Every `| `file` | lines |` row of the reading order gives the file's line count, and every
    top-level .py file and world is in it."""
    rows = re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \|", readme(), re.M)
    assert rows
    for name, lines in rows:
        with open(os.path.join(ROOT, name)) as f:
            assert len(f.readlines()) == int(lines), f"{name}: README says {lines} lines"
    listed = {name for name, _ in rows}
    files = {n for n in os.listdir(ROOT) if n.endswith(".py")}
    files |= {f"worlds/{n}" for n in os.listdir(os.path.join(ROOT, "worlds")) if n.endswith(".py")}
    assert files == listed


def test_example_log_is_the_committed_run():
    """Each line of the README's example log (indented, beginning eval/grpo/ofsd/|) is a line of
    docs/data/main-job.log, in the same order."""
    quoted = [line[4:] for line in readme().splitlines()
              if re.match(r"    (eval|grpo|ofsd|\|) ", line)]
    with open(os.path.join(ROOT, "docs", "data", "main-job.log")) as f:
        log = f.read().splitlines()
    assert quoted
    at = 0
    for line in quoted:
        assert line in log[at:], line
        at = log.index(line, at) + 1


def test_readme_is_a_guide_of_at_most_10_kb():
    """README.md stays under 10,000 bytes; the lab notebook is docs/."""
    assert len(readme().encode()) <= 10_000
