"""evolve.py end to end on a micro configuration: files, resume, overrides (two ranks: test_fsdp.py)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from model import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def evolve(args, cwd=ROOT, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "evolve.py", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, **kw)


def weights(out):
    return load_file(os.path.join(out, "checkpoint", "model", "model.safetensors"))


def test_one_iteration_end_to_end(micro, tmp_path):
    """One GRPO + OFSD iteration writes metrics, results and a checkpoint that loads."""
    out = str(tmp_path / "run")
    p = evolve(micro + ["--iterations=1", f"--out_dir={out}"])
    assert p.returncode == 0, p.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in open(os.path.join(out, "metrics.jsonl"))]
    assert kinds == ["eval", "grpo_step", "grpo_step", "eval", "ofsd_round", "eval"]
    state = json.load(open(os.path.join(out, "checkpoint", "state.json")))
    assert state["done"] == 3 and state["step"] == 2
    load(os.path.join(out, "checkpoint", "model"))
    assert "| round | after |" in open(os.path.join(out, "results.md")).read()
    assert open(os.path.join(out, "curves.svg")).read().startswith("<svg")
    assert "grpo | it 0 | step    1 | reward" in p.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows[0]["summary"]["all"]["em"] > 0  # the fixture's agent answers: this run can learn
    assert any(r["pg"] != 0 for r in rows if r["kind"] == "grpo_step")  # a group of both outcomes: A != 0
    assert rows[4]["pairs"] >= 1 and rows[4]["losses"]  # the OFSD round mined pairs and distilled them


@pytest.fixture(scope="module")
def killed_and_resumed(micro, tmp_path_factory):
    """(a run never killed, a run SIGKILLed mid-run then resumed with --resume): their out_dirs."""
    d = tmp_path_factory.mktemp("kill")
    full, cut = str(d / "full"), str(d / "cut")
    args = micro + ["--iterations=2"]
    assert evolve(args + [f"--out_dir={full}"]).returncode == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "evolve.py", *args, f"--out_dir={cut}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = os.path.join(cut, "checkpoint", "state.json")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(state) and json.load(open(state))["done"] >= 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    last = state if os.path.exists(state) else os.path.join(cut, "checkpoint.old", "state.json")
    assert json.load(open(last))["done"] < 5  # killed before the end
    p = evolve(args + [f"--out_dir={cut}", "--resume"])
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    return full, cut


def test_kill_and_resume_matches_uninterrupted(killed_and_resumed):
    """SIGKILL mid-run, then --resume: same loop position and weights as a run never killed."""
    full, cut = killed_and_resumed
    a, b = (json.load(open(os.path.join(d, "checkpoint", "state.json"))) for d in (full, cut))
    assert (a["done"], a["step"]) == (b["done"], b["step"]) == (5, 4)
    wa, wb = weights(full), weights(cut)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


def test_kill_and_resume_logs_each_step_once(killed_and_resumed):
    """After a kill and --resume, metrics.jsonl holds the same records, in order, as a run never killed."""
    def records(d):
        return [(r["kind"], r.get("step"), r.get("round")) for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))]
    full, cut = killed_and_resumed
    assert records(cut) == records(full)


def test_unknown_key_is_rejected():
    """--key=value with an unknown key fails and lists the keys."""
    p = evolve(["--learning_rate=1"])
    assert p.returncode != 0 and "unknown argument '--learning_rate=1'" in p.stderr and "tau_clip" in p.stderr


def test_ofsd_round_gives_back_the_optimizer_state_it_let_go(micro, tmp_path):
    """The OFSD round frees GRPO's AdamW moments (fsdp.park) and gives them back: after it the
    optimizer state equals the one the GRPO round left (a GRPO-only run of the same round)."""
    states = {}
    for name, extra in (("grpo", ["--ofsd_rounds=false"]), ("ofsd", [])):
        out = str(tmp_path / name)
        p = evolve(micro + ["--iterations=1", f"--out_dir={out}"] + extra)
        assert p.returncode == 0, p.stderr[-3000:]
        states[name] = torch.load(os.path.join(out, "checkpoint", "optimizer.pt"), weights_only=True)["state"]
    assert states["grpo"].keys() == states["ofsd"].keys() and states["grpo"]
    for k, v in states["grpo"].items():
        assert all(torch.equal(v[n], states["ofsd"][k][n]) for n in v), k


def test_bad_view_settings_are_refused_before_anything_is_written(tmp_path):
    """A bad --ofsd_context or --ofsd_positions is refused by the command, naming the key, with no run folder."""
    out = tmp_path / "run"
    p = evolve([f"--out_dir={out}", "--ofsd_context=answer", "--ofsd_positions=all"])
    assert p.returncode != 0 and not out.exists()
    assert "--ofsd_context='answer'" in p.stderr and "--ofsd_positions='all'" in p.stderr


@pytest.mark.parametrize("bad", ["--ofsd_loss=kll", "--ppo_mini_batch=4", "--grpo_lora_rank=-1"])
def test_a_bad_setting_is_refused_before_anything_is_written(micro, tmp_path, bad):
    """An unknown --ofsd_loss, a PPO mini-batch larger than the step's questions, a negative LoRA rank:
    each refused by the command, naming the key, with no run folder."""
    out = tmp_path / "run"
    p = evolve(micro + [f"--out_dir={out}", bad])  # micro: --questions_per_step=2
    assert p.returncode != 0 and not out.exists()
    assert bad.split("=")[0] in p.stderr


def test_compile_off_cuda_is_refused_before_anything_is_written(tmp_path):
    """--compile=true on a CPU is refused, naming the setting and the device, with no run folder."""
    out = tmp_path / "run"
    p = evolve([f"--out_dir={out}", "--compile=true", "--device=cpu"])
    assert p.returncode != 0 and not out.exists()
    assert "--compile=true" in p.stderr and "cpu" in p.stderr


def test_help_lists_every_setting_with_its_default_and_comment():
    """--help exits 0 and prints each setting once, as --key=default, with the comment beside it in evolve.py."""
    sys.path.insert(0, ROOT)
    import evolve as ev
    p = evolve(["--help"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    for key in ev.config_keys:
        mine = [line for line in lines if line.startswith(f"  --{key}={ev.DEFAULTS[key]} ")]
        assert len(mine) == 1, key
        source = next(line for line in open(os.path.join(ROOT, "evolve.py")) if line.startswith(f"{key} = "))
        assert mine[0].split(None, 1)[1].strip() == source.split("# ", 1)[1].strip(), key
    e = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert "so few large batches" in e.stdout  # a comment's continuation line (eval.py's --batch)
    assert "PRIVILEGED" not in ev.config_keys and "--PRIVILEGED" not in p.stdout


def test_overrides_parse_types():
    """An int is accepted for a float; bools take true/false; --resume alone is True."""
    sys.path.insert(0, ROOT)
    import configurator
    import evolve

    def parse_overrides(argv):
        return configurator.parse(argv, evolve.DEFAULTS, evolve.__file__, evolve.__doc__)
    o = parse_overrides(["--lr=1", "--ofsd_rounds=false", "--resume", "--grpo_steps=7", "--out_dir=x"])
    assert o == {"lr": 1.0, "ofsd_rounds": False, "resume": True, "grpo_steps": 7, "out_dir": "x"}
    assert isinstance(o["lr"], float)
    with pytest.raises(SystemExit, match="--grpo_steps=1.5: expected int"):
        parse_overrides(["--grpo_steps=1.5"])


def test_a_renamed_setting_is_refused_with_its_new_name():
    """OFSD's old LoRA keys (--lora_rank, ...) and --ofsd_micro_batch are refused, each naming its new key."""
    sys.path.insert(0, ROOT)
    import configurator
    import evolve
    for old, new in evolve.RENAMED.items():
        with pytest.raises(SystemExit, match=f"--{old} is now --{new}"):
            configurator.parse([f"--{old}=1"], evolve.DEFAULTS, evolve.__file__, evolve.__doc__, evolve.RENAMED)
        assert new in evolve.DEFAULTS and old not in evolve.DEFAULTS


def test_no_warmup_is_zero_warmup_steps():
    """--warmup_steps=0 passes the GRPO group's check and means the full learning rate from the first step."""
    sys.path.insert(0, ROOT)
    import evolve
    import grpo
    _, cfg, _ = evolve.settings_groups(dict(evolve.DEFAULTS, warmup_steps=0))
    assert cfg.warmup_steps == 0 and grpo.learning_rate(cfg, 1) == cfg.lr
    assert grpo.learning_rate(dataclasses.replace(cfg, warmup_steps=4), 1) == cfg.lr / 4


def test_overrides_expand_home_in_paths():
    """--model_dir=~/x names the home folder's x (bash expands no ~ after `=`); other strings stay."""
    sys.path.insert(0, ROOT)
    import configurator
    import evolve

    def parse_overrides(argv):
        return configurator.parse(argv, evolve.DEFAULTS, evolve.__file__, evolve.__doc__)
    o = parse_overrides(["--model_dir=~/ckpt", "--out_dir=runs/a", "--device=cpu"])
    assert o == {"model_dir": os.path.join(os.path.expanduser("~"), "ckpt"), "out_dir": "runs/a", "device": "cpu"}


def test_curves_svg_draws_mean_and_band():
    """The chart: per variant and panel, a mean line through every evaluation and a min-max band."""
    import xml.etree.ElementTree as ET

    from eval import curves_svg

    def row(after, it, em, searches):
        return dict(after=after, iteration=it, summary={"all": dict(em=em, searches=searches)})
    runs = [[row("start", 0, 0.2, 1.0), row("grpo", 0, 0.4, 1.5), row("ofsd", 0, 0.5, 1.2)],
            [row("start", 0, 0.2, 1.0), row("grpo", 0, 0.6, 1.7), row("ofsd", 0, 0.3, 1.4)]]
    svg = ET.fromstring(curves_svg({"a": runs, "b": [[row("start", 0, 0.2, 1.0), row("grpo", 0, 0.5, 1.1)]]}))
    ns = "{http://www.w3.org/2000/svg}"
    lines, bands = svg.findall(f"{ns}polyline"), svg.findall(f"{ns}polygon")
    assert len(lines) == len(bands) == 4  # 2 variants x 2 panels
    assert [len(p.get("points").split()) for p in lines] == [3, 2, 3, 2]
    assert [len(p.get("points").split()) for p in bands] == [6, 4, 6, 4]
    mean_y = float(lines[0].get("points").split()[1].split(",")[1])  # variant a, EM after GRPO: mean 0.5
    lo_y, hi_y = (float(bands[0].get("points").split()[i].split(",")[1]) for i in (4, 1))  # min 0.4, max 0.6
    assert hi_y < mean_y < lo_y and abs(mean_y - (lo_y + hi_y) / 2) < 0.2  # SVG y grows downwards


def test_curves_png_fits_the_picture():
    """The chart rendered to PNG: both panels' frames and last x label lie inside the picture (the
    rightmost columns are background), and one run's legend promises no band."""
    import io

    PIL = pytest.importorskip("PIL.Image")
    resvg_py = pytest.importorskip("resvg_py")
    from eval import curves_svg
    rows = [dict(after=a, iteration=it, summary={"all": dict(em=e, searches=1 + e)}) for a, it, e in
            (("start", 0, 0.38), ("grpo", 0, 0.7), ("ofsd", 0, 0.7), ("grpo", 1, 0.68), ("ofsd", 1, 0.676))]
    svg = curves_svg({"runs/toy": [rows]})
    assert "1 run</text>" in svg and "band" not in svg
    png = resvg_py.svg_to_bytes(svg_string=svg, sans_serif_family="DejaVu Sans", font_dirs=["/usr/share/fonts"])
    img = PIL.open(io.BytesIO(bytes(png))).convert("L")
    W, H = img.size
    px = img.load()
    inked = [x for x in range(W) if any(px[x, y] < 200 for y in range(H))]  # columns holding a line or a letter
    assert inked and max(inked) < W - 4  # nothing reaches the right edge
    frames = [x for x in range(W) if sum(px[x, y] < 200 for y in range(H)) > 200]  # the two frames' sides
    assert len(frames) >= 4 and max(frames) < W - 20, frames


def test_kl_model_is_refreshed_each_round(micro, killed_and_resumed, tmp_path):
    """kl_policy="round": each GRPO round's first update has KL exactly 0 (the KL model is the policy
    it starts from); "initial": the second round's first update sees the moved policy (KL > 0)."""
    full, _ = killed_and_resumed  # 2 iterations, the default kl_policy="round"
    first = [r for r in map(json.loads, open(os.path.join(full, "metrics.jsonl")))
             if r["kind"] == "grpo_step" and r["step"] in (1, 3)]  # each round's first step (2 steps a round)
    assert [r["kl"] for r in first] == [0.0, 0.0]
    out = str(tmp_path / "initial")
    p = evolve(micro + ["--iterations=2", "--kl_policy=initial", f"--out_dir={out}"])
    assert p.returncode == 0, p.stderr[-3000:]
    first = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
             if r["kind"] == "grpo_step" and r["step"] in (1, 3)]
    assert first[0]["kl"] == 0.0 and first[1]["kl"] > 0


def test_forked_run_is_the_run_from_scratch(micro, killed_and_resumed, tmp_path):
    """checkpoint.fork_run (the ablations' fork): the GRPO-only first round, copied and resumed as an
    OFSD variant, writes the records and weights of that variant's run from scratch."""
    full, _ = killed_and_resumed  # micro, 2 iterations, the default OFSD settings
    first, forked = str(tmp_path / "first"), str(tmp_path / "forked")
    assert evolve(micro + ["--ofsd_rounds=false", "--iterations=1", f"--out_dir={first}"]).returncode == 0
    checkpoint.fork_run(first, forked, dict(ofsd_rounds=True))
    p = evolve(micro + ["--iterations=2", f"--out_dir={forked}", "--resume"])
    assert p.returncode == 0, p.stderr[-3000:]

    def records(d):
        return [{k: v for k, v in r.items() if k not in ("seconds", "rollout_seconds", "state_bytes")}
                for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))]
    assert records(forked) == records(full)
    wa, wb = weights(full), weights(forked)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
