"""The requirements files admit only versions the code runs on."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transformers_floor_admits_the_dtype_spelling():
    """Every from_pretrained call spells dtype= (transformers >= 4.56), and requirements-dev's floor is that."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    calls = [(f, line) for f in files for line in open(os.path.join(ROOT, f)) if "from_pretrained(" in line]
    assert calls and not [c for c in calls if "torch_dtype=" in c[1]], [c for c in calls if "torch_dtype=" in c[1]]
    floor = re.search(r"^transformers>=(\d+)\.(\d+)", open(os.path.join(ROOT, "requirements-dev.txt")).read(), re.M)
    assert floor and (int(floor[1]), int(floor[2])) >= (4, 56)
