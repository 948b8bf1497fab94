"""bench/gpu_check.py --smoke: every section of the GPU check runs on CPU at tiny shapes."""

import json
import os
import subprocess
import sys

import clipped_kl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_runs_every_section(tmp_path):
    """The smoke run prints its table, writes its JSON, and every section's rows pass."""
    out = tmp_path / "smoke.json"
    p = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", f"--out={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| section | what | numbers | ok |" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["section"] for r in rows} == {"loss", "generate", "profile", "loop", "nccl"}
    assert all(r["ok"] for r in rows)
    kernel_rows = sum(r["section"] == "loss" and "err_over_bound" in str(r) for r in rows)
    if clipped_kl.triton is not None:
        assert kernel_rows == 6  # 3 clips x 2 dtypes
    else:  # skipped, and the table says why
        assert kernel_rows == 0 and "Triton is not installed" in p.stdout
    compiled = [r for r in rows if r["what"].endswith(", compiled")]
    assert len(compiled) == 2 and all("teacher_forced_logits_max_err" in r or "skipped" in r["note"] for r in compiled)
    loop = next(r for r in rows if r["section"] == "loop")
    assert loop["grpo_tokens"] > 0 and loop["ofsd_pairs"] > 0  # the OFSD round mined pairs and distilled
