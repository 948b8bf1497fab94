"""Nothing a user owns is deleted, and bad input or settings fail early with a named error."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from checkpoint import RUN_MARKER, keep_first_lines, save_checkpoint
from eval import read_questions
from model import load, save
from index_build import build_index
from retriever import load_index
from conftest import random_model, tiny_config
from test_evolve import ROOT, evolve

sys.path.insert(0, ROOT)
from evolve import DEFAULTS, check_context, settings_groups  # noqa: E402


def good_config(**changes):
    cfg = dict(DEFAULTS)  # evolve.py's defaults
    cfg.update(changes)
    return cfg


# ----------------------------------------------------------------------------------------------
# run directories

def test_out_dir_with_user_files_is_refused(micro, tmp_path):
    """A non-empty out_dir without our marker is refused and every file in it is kept."""
    out = tmp_path / "mine"
    (out / ".git").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    p = evolve(micro + [f"--out_dir={out}"])
    assert p.returncode != 0 and "holds no run of evolve.py" in p.stderr and str(out) in p.stderr
    assert sorted(os.listdir(out)) == [".git", "notes.txt"] and (out / "notes.txt").read_text() == "keep me"


def test_earlier_run_needs_overwrite_and_keeps_user_files(micro, tmp_path):
    """An earlier run's out_dir is refused without --overwrite=true; with it only the run's files go."""
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text('{"kind": "old"}\n')
    (out / "notes.txt").write_text("keep me")
    p = evolve(micro + [f"--out_dir={out}", "--iterations=0"])
    assert p.returncode != 0 and "--overwrite=true" in p.stderr
    assert (out / "metrics.jsonl").read_text() == '{"kind": "old"}\n'
    p = evolve(micro + [f"--out_dir={out}", "--iterations=0", "--overwrite=true"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "keep me"
    assert [json.loads(x)["kind"] for x in open(out / "metrics.jsonl")] == ["eval"]


def test_resume_without_checkpoint_is_an_error(micro, tmp_path):
    """--resume with no checkpoint names the directory and creates nothing."""
    out = tmp_path / "typo"
    p = evolve(micro + [f"--out_dir={out}", "--resume"])
    assert p.returncode != 0 and "no checkpoint in" in p.stderr and str(out) in p.stderr
    assert not out.exists()


def test_resume_refuses_changed_settings(micro, tmp_path):
    """--resume lists the keys that changed the run's meaning; a harmless one (eval_batch) passes."""
    out = tmp_path / "run"
    assert evolve(micro + [f"--out_dir={out}", "--iterations=0"]).returncode == 0
    p = evolve(micro + [f"--out_dir={out}", "--iterations=0", "--resume", "--ofsd_rounds=false", "--lr=0.5"])
    assert p.returncode != 0 and "lr=0.0001 (now 0.5)" in p.stderr and "ofsd_rounds=True (now False)" in p.stderr
    p = evolve(micro + [f"--out_dir={out}", "--iterations=0", "--resume", "--eval_batch=7"])
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-2000:]


def test_metrics_are_cut_back_to_the_checkpoint():
    """keep_first_lines drops the rows a killed round wrote after the last checkpoint."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "metrics.jsonl")
        with open(path, "w") as f:
            f.writelines(f'{{"step": {i}}}\n' for i in range(5))
        keep_first_lines(path, 3)
        assert [json.loads(x)["step"] for x in open(path)] == [0, 1, 2]


# ----------------------------------------------------------------------------------------------
# settings

@pytest.mark.parametrize("change,named", [
    (dict(group_size=1), "--group_size=1"), (dict(kl_policy="foo"), "--kl_policy='foo': must be one of round"),
    (dict(grpo_steps=-1), "--grpo_steps=-1"), (dict(iterations=-1), "--iterations=-1"),
    (dict(max_turn_tokens=0), "--max_turn_tokens=0"), (dict(questions_per_step=0), "--questions_per_step=0"),
    (dict(micro_batch=0), "--micro_batch=0"), (dict(top_p=1.5), "--top_p=1.5: must be in (0, 1]"),
    (dict(temperature=0.0), "--temperature=0.0"), (dict(dtype="fp8"), "--dtype='fp8'"),
    (dict(train_file="/nonexistent.jsonl"), "--train_file=/nonexistent.jsonl: no such file"),
    (dict(lr=float("inf")), "--lr=inf: must be a finite number"), (dict(tau_clip=float("nan")), "--tau_clip=nan"),
    (dict(ofsd_clip="token"), "--ofsd_clip='token': must be one of vocab, position, none"),
    (dict(search_workers=0), "--search_workers=0"),
    (dict(ofsd_context="answer"), "--ofsd_context='answer': must be one of full, no_answer, queries, group_queries"),
    (dict(ofsd_positions="search"), "--ofsd_positions='search': must be one of policy, queries"),
])
def test_bad_setting_is_named(change, named):
    """Each out-of-range setting is refused before anything is written, naming key and range."""
    with pytest.raises(SystemExit, match=None) as e:
        settings_groups(good_config(**change))
    assert named in str(e.value)


def test_defaults_pass_the_checks():
    """The shipped configuration passes every group's checks."""
    settings_groups(good_config())


def test_trajectory_longer_than_the_context_is_refused(micro, tmp_path):
    """Turns that cannot fit the model's context are refused before any allocation, naming the keys."""
    out = tmp_path / "run"
    p = evolve(micro + ["--max_turns=100000", f"--out_dir={out}"])
    assert p.returncode != 0 and not out.exists()
    assert "--max_turns=100000" in p.stderr and "over the model's context of 32,768" in p.stderr


def test_context_check_counts_what_the_cache_holds(tokenizer):
    """check_context counts a response as rollout sizes its KV cache (rollout.max_response_tokens):
    where the invalid-action message is longer than the observation cap, the message counts."""
    from rollout import RolloutConfig, make_prompt, max_response_tokens
    question, turns = "which river flows through Paris", dict(max_turns=3, max_turn_tokens=10, max_obs_tokens=1)
    prompt = len(tokenizer.encode(tokenizer.chat_prompt(make_prompt(question))))
    need = prompt + max_response_tokens(tokenizer, RolloutConfig(**turns, top_k=3))
    assert need > prompt + 4 * 11 + 3 * 1  # the message (not the 1-token cap) bounds each turn's injected text
    sampling = RolloutConfig(**turns, top_k=3)
    check_context(need, tokenizer, [{"question": question}], sampling, 5, None)  # fits exactly
    with pytest.raises(SystemExit, match="over the model's context of"):
        check_context(need - 1, tokenizer, [{"question": question}], sampling, 5, None)


def test_empty_train_file_fails_before_out_dir(micro, tmp_path):
    """An empty train file is refused at once; out_dir is not created."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "run"
    p = evolve([a for a in micro if not a.startswith("--train_file")] + [f"--train_file={empty}", f"--out_dir={out}"])
    assert p.returncode != 0 and f"--train_file={empty}" in p.stderr and not out.exists()


# ----------------------------------------------------------------------------------------------
# question files and eval.py

@pytest.mark.parametrize("line,named", [
    ('{"question": "q", "golden_answers": [3, null]}', "golden_answers must be a non-empty list of strings"),
    ('{"question": "\\udcff", "golden_answers": ["a"]}', "UnicodeEncodeError"),
    ('{"question": "q"}', "needs 'question' and 'golden_answers'"),
    ('not json', "JSONDecodeError"),
])
def test_bad_question_line_is_named(tmp_path, line, named):
    """A bad question line is an error naming file:line and the fault."""
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "fine", "golden_answers": ["a"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:2") as e:
        read_questions(str(path))
    assert named in str(e.value)


def test_empty_question_file_is_named(tmp_path):
    """A file without questions is an error naming it (not a ZeroDivisionError later)."""
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=f"{path}: no questions"):
        read_questions(str(path))


def test_eval_checks_every_path_first(tmp_path):
    """eval.py with a missing model folder and a missing second --data file fails before loading anything,
    one line naming each setting, no traceback, nothing written."""
    good = tmp_path / "a.jsonl"
    good.write_text('{"question": "q", "golden_answers": ["a"]}\n')
    p = subprocess.run([sys.executable, "eval.py", f"--model_dir={tmp_path / 'no_model'}", f"--index_dir={tmp_path}",
                        f"--data={good},{tmp_path / 'missing.jsonl'}", f"--out_file={tmp_path / 'o.jsonl'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr and not (tmp_path / "o.jsonl").exists()
    lines = p.stderr.splitlines()
    assert any(line.strip().startswith("--model_dir=") and "no_model" in line for line in lines)
    assert any(line.strip().startswith("--data=") and "missing.jsonl" in line for line in lines)


# ----------------------------------------------------------------------------------------------
# checkpoints

@pytest.fixture
def saved(tmp_path, tokenizer):
    path = str(tmp_path / "ckpt")
    save(random_model(tiny_config()), tokenizer, path)
    return path


def test_config_that_is_not_json_is_named(saved):
    """A config.json that is not JSON is an error naming the file."""
    with open(os.path.join(saved, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load(saved)


def test_truncated_safetensors_is_named(saved):
    """A truncated model.safetensors is an error naming the file."""
    path = os.path.join(saved, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="model.safetensors: .*truncated or corrupt"):
        load(saved)


def test_other_architecture_is_refused(saved):
    """A config whose architectures is not Qwen2ForCausalLM is refused even with model_type qwen2."""
    cfg_path = os.path.join(saved, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="architectures is \\['MistralForCausalLM'\\]"):
        load(saved)


def test_save_refuses_a_folder_of_user_files(tmp_path, tokenizer):
    """model.save never replaces a folder that holds anything but checkpoint files."""
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a checkpoint's"):
        save(random_model(tiny_config()), tokenizer, str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_save_over_a_half_removed_old_folder(tmp_path, tokenizer):
    """A kill inside the last save's cleanup leaves a partial .old beside the new folder; the next save succeeds."""
    path = str(tmp_path / "model")
    save(random_model(tiny_config(), seed=0), tokenizer, path)
    os.makedirs(path + ".old")
    (tmp_path / "model.old" / "config.json").write_text("{}")  # what rmtree had not removed yet
    model = random_model(tiny_config(), seed=1)
    save(model, tokenizer, path)
    assert not os.path.exists(path + ".old")
    assert torch.equal(load(path)[0].lm_head_weight, model.lm_head_weight)


def test_checkpoint_over_a_half_removed_old_folder(tmp_path, tokenizer):
    """The same for a run's checkpoint: save_checkpoint swaps in the new one and the stale .old goes."""
    ckpt = str(tmp_path / "checkpoint")
    model = random_model(tiny_config())
    opt = torch.optim.AdamW(model.parameters())
    for done in (1, 2):
        if done == 2:
            os.makedirs(os.path.join(ckpt + ".old", "model"))  # a kill inside the first swap's rmtree
        save_checkpoint(ckpt, model, tokenizer, opt, random.Random(0), torch.Generator(), dict(done=done), 0)
    assert json.load(open(os.path.join(ckpt, "state.json")))["done"] == 2
    assert not os.path.exists(ckpt + ".old")


# ----------------------------------------------------------------------------------------------
# the retriever

def write_corpus(path, lines):
    with open(path, "wb") as f:
        f.write(b"".join(x if isinstance(x, bytes) else x.encode() for x in lines))


GOOD = ['{"id": "1", "contents": "\\"A\\"\\nalpha beta"}\n', '{"id": "2", "contents": "\\"B\\"\\ngamma"}\n']


@pytest.mark.parametrize("bad,named", [
    (b'{"id": "3", "contents": "\\"C\\"\\n\xff\xfe"}\n', "UnicodeDecodeError"),
    ('{"id": "3", "text": "no title"}\n', "no 'contents' field"),
])
def test_bad_corpus_line_is_named(tmp_path, bad, named):
    """A non-UTF-8 or field-less corpus line is an error naming file:3 and the fault."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, GOOD + [bad])
    with pytest.raises(ValueError, match=f"{corpus}:3") as e:
        build_index(str(corpus), str(tmp_path / "idx"))
    assert named in str(e.value) and not (tmp_path / "idx").exists()


@pytest.mark.parametrize("name", ["meta.json", "scores.npy"])
def test_empty_index_file_is_named(tmp_path, name):
    """A 0-byte meta.json or scores.npy is an error naming that file."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, GOOD)
    build_index(str(corpus), str(tmp_path / "idx"))
    open(tmp_path / "idx" / name, "w").close()
    with pytest.raises(ValueError, match=name):
        load_index(str(tmp_path / "idx"))


def test_build_refuses_a_folder_of_user_files(tmp_path):
    """retriever build never replaces a folder holding anything but index files."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, GOOD)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not an index folder"):
        build_index(str(corpus), str(mine))
    assert os.listdir(mine) == ["notes.txt"]


def test_rebuild_keeps_a_whole_index_at_every_instant(tmp_path, monkeypatch):
    """A rebuild killed between its renames leaves the old index whole at .old, which load names."""
    corpus, idx = tmp_path / "c.jsonl", str(tmp_path / "idx")
    write_corpus(corpus, GOOD)
    build_index(str(corpus), idx)
    real_replace = os.replace

    def killed_after_first_rename(src, dst):
        real_replace(src, dst)
        if dst == idx + ".old":
            raise KeyboardInterrupt  # the kill
    monkeypatch.setattr(os, "replace", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        build_index(str(corpus), idx)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(FileNotFoundError, match=r"previous index is whole at .*idx\.old"):
        load_index(idx)
    assert load_index(idx + ".old").search(["alpha"], 1)[0][0][0] == 0
    assert load_index(idx + ".tmp").search(["gamma"], 1)[0][0][0] == 1  # the new one, whole too
    build_index(str(corpus), idx)  # a rebuild recovers and cleans up
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("idx")) == ["idx"]
    assert np.asarray(load_index(idx).scores).size > 0
