"""Exact-match evaluation under the Search-R1 protocol: greedy search rollouts, the paper's table.

For every question: one greedy rollout (rollout.py), the answer is the last <answer> the model
wrote, EM as in rollout.py (normalised, any gold answer). Reported per data set (or, for files whose
questions carry a `type`, per type too): EM, mean searches per question, and the share of
answers in the right format (an <answer> tag was written). Per-question JSON lines (question,
gold answers, full trajectory text, answer, EM, searches) go to --out.

Left out: sampling-based metrics (pass@k), LLM-as-judge or F1 scoring.

    python eval.py --model_dir=DIR --index_dir=DIR --data=nq_test.jsonl,hotpotqa_dev.jsonl [--limit=N] [--show=2]
"""

import json
import math
import os
import resource
import sys

import torch

import configurator
from checkpoint import base_dir, load_policy, write_atomic
from fsdp import behind_hidden, check_compile, device_and_dtype
from model import Qwen2Config
from retriever import load_index
from rollout import SEARCH_R1, RolloutConfig, exact_match, rollout

# ---------------------------------------------------------------------------------------------
# settings of `python eval.py`, overridable as --key=value (configurator.py; --help lists them)
model_dir = ""                 # a checkpoint folder, or a policy folder (a base and its adapters, checkpoint.py)
index_dir = ""                 # the BM25 index (index_build.py)
data = ""                      # comma-separated FlashRAG .jsonl question files
limit = 0                      # the first N questions of each file; 0 = all
show = 0                       # print this many trajectories per file
out_file = "eval_results.jsonl"  # per-question results, JSON lines
batch = 160                    # questions decoded at once: a greedy batch lasts as long as its longest row,
                               # so few large batches; memory grows with it (docs/benchmarks.md)
max_turns = SEARCH_R1.max_turns              # searching turns before the answer-only turn
max_turn_tokens = SEARCH_R1.max_turn_tokens  # per-turn response cap
max_obs_tokens = SEARCH_R1.max_obs_tokens    # observation cap
top_k = SEARCH_R1.top_k                      # documents per search
compile = False                # decoding steps through torch.compile as CUDA graphs (one process on CUDA; generate.compiled)
device = "auto"                # auto (CUDA when there is one), cpu, cuda, cuda:N
dtype = "auto"                 # auto: bfloat16 on CUDA, and for a real checkpoint on a CPU with native bfloat16
# ---------------------------------------------------------------------------------------------
DEFAULTS = configurator.settings(globals())


def evaluate(model, tokenizer, index, questions, cfg, batch):
    """Greedy rollouts (cfg: a RolloutConfig, its sampling ignored), `batch` questions at a time, for
    FlashRAG-format questions -> one result dict per question."""
    out, greedy = [], cfg.greedy()
    for s in range(0, len(questions), batch):
        part = questions[s:s + batch]
        trajs = rollout(model, tokenizer, index, [q["question"] for q in part], 1, greedy)
        for q, t in zip(part, trajs):
            out.append(dict(question=q["question"], golden_answers=q["golden_answers"], type=q.get("type"),
                            answer=t.answer, em=exact_match(t.answer, q["golden_answers"]),
                            searches=t.n_search, formatted=t.answer is not None,
                            trajectory=t.render(tokenizer)))
    return out


def grpo_line(m, it):
    line = (f"grpo | it {it} | step {m['step']:4d} | reward {m['reward']:.3f} | loss {m['loss']:+.4f} | "
            f"kl {m['kl']:.5f} | clip {m['clip_frac']:.3f} | entropy {m['entropy']:.3f} | "
            f"searches {m['searches']:.2f} | tokens {m['tokens']:6d} | {m['seconds']:.1f}s")
    if "credit" in m:  # the teacher's token credit: mean w - 1 by segment, rows with A > 0 / A < 0
        c = m["credit"]

        def f(x):
            return "-" if x is None else f"{x:+.3f}"
        line += (f" | credit lambda {c['credit_lambda']:.2f} | w-1 A>0 think/search/answer "
                 f"{f(c['think_pos'])}/{f(c['search_pos'])}/{f(c['answer_pos'])} A<0 {f(c['think_neg'])}/"
                 f"{f(c['search_neg'])}/{f(c['answer_neg'])} | after departure "
                 f"{'-' if c['after_departure'] is None else format(c['after_departure'], '.2f')}")
    return line


def ofsd_line(row, m):
    line = f"ofsd | it {row['iteration']} | pairs {m['pairs']} ({m['incorrect_students']} with an incorrect student)"
    if m.get("nll_before") is not None and m["losses"]:  # tau_ref's NLL in the student view, the rft control's loss
        line += f" | nll {m['nll_before']:.4f} -> {m['nll_after']:.4f}"
    if "loss_before" in m:  # what distillation did: the loss, the true KL, the clip, P_student(teacher's top token)
        line += (f" | loss {m['loss_before']:.5f} -> {m['loss_after']:.5f} | true KL {m['kl_true_before']:.4f} -> "
                 f"{m['kl_true_after']:.4f} | clipped {m['clip_frac_before']:.2f} | P(top) {m['p_top_before']:.3f}"
                 f" -> {m['p_top_after']:.3f}")
    if "teacher_em" in m:  # the diagnostics: headroom (teacher vs student view) and effect on its questions
        line += f" | teacher EM {m['teacher_em']:.3f} student EM {m['student_em']:.3f}"
        if m["teacher_em_incorrect"] is not None:  # the pairs distillation is meant for
            line += (f" (incorrect students: {m['teacher_em_incorrect']:.3f} / "
                     f"{m['mined_em_before_incorrect']:.3f})")
        line += f" | disagree {m['disagree']:.3f} | mined EM {m['mined_em_before']:.3f} -> {m['mined_em_after']:.3f}"
    return line


def summarize(results, key=None):
    """{group: dict(n, em, searches, format)} grouped by results[key] (plus "all")."""
    groups = {"all": results}
    if key:
        for r in results:
            if r.get(key):
                groups.setdefault(r[key], []).append(r)
    return {g: dict(n=len(rs), em=sum(r["em"] for r in rs) / len(rs),
                    searches=sum(r["searches"] for r in rs) / len(rs),
                    format=sum(r["formatted"] for r in rs) / len(rs)) for g, rs in groups.items() if rs}


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def curves_svg(series):
    """Learning curves as an SVG string, written by hand: test EM and searches per question at
    each evaluation, one colour per variant, the mean over its runs as a line and the lowest and
    highest run as a band. series = {variant: [one run's evaluation rows, ...]}; a row has
    `after` ("start", "grpo", "ofsd"), `iteration` and `summary` (as evolve.py records them).
    x = the row's place in the schedule start, GRPO 1, OFSD 1, GRPO 2, ... (GRPO-only runs skip
    the OFSD places, so rounds at equal GRPO steps line up)."""
    def place(row):
        return 0 if row["after"] == "start" else 1 + 2 * row["iteration"] + (row["after"] == "ofsd")
    points = {}  # variant -> [(x, [EM over runs], [searches over runs])], by x
    for name, runs in series.items():
        by_x = {}
        for rows in runs:
            for row in rows:
                em, se = by_x.setdefault(place(row), ([], []))
                em.append(row["summary"]["all"]["em"])
                se.append(row["summary"]["all"]["searches"])
        points[name] = sorted((x, em, se) for x, (em, se) in by_x.items())
    n_x = 1 + max(x for pts in points.values() for x, _, _ in pts)
    w, h, left, top, gap, right = 420, 240, 48, 28, 70, 40  # one panel's plot area, margins

    def xs(x):
        return left + w * x / max(n_x - 1, 1)

    def fmt(ps):
        return " ".join(f"{a:.1f},{b:.1f}" for a, b in ps)

    width, height = 2 * (left + w) + gap + right, top + h + 60 + 18 * len(series)  # right: the last x label's half
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">', '<rect width="100%" height="100%" fill="white"/>']
    for panel, (title, k) in enumerate((("test exact match", 1), ("searches per question", 2))):
        x0 = panel * (left + w + gap)
        vals = [v for pts in points.values() for p in pts for v in p[k]]
        lo, hi = (0.0, max(1.0, max(vals))) if k == 1 else (0.0, max(vals) * 1.1 or 1.0)

        def ys(v, lo=lo, hi=hi):
            return top + h - h * (v - lo) / (hi - lo)
        out.append(f'<text x="{x0 + left + w / 2}" y="16" text-anchor="middle" font-weight="bold">{title}</text>')
        out.append(f'<rect x="{x0 + left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
        for i in range(5):  # y grid with labels
            v = lo + (hi - lo) * i / 4
            out.append(f'<line x1="{x0 + left}" x2="{x0 + left + w}" y1="{ys(v):.1f}" y2="{ys(v):.1f}" stroke="#eee"/>'
                       f'<text x="{x0 + left - 4}" y="{ys(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        for x in range(n_x):  # x labels: the schedule
            label = "start" if x == 0 else f"{'GRPO' if x % 2 else 'OFSD'} {(x + 1) // 2}"
            out.append(f'<text x="{x0 + xs(x):.1f}" y="{top + h + 16}" text-anchor="middle">{label}</text>')
        for c, (name, pts) in enumerate(points.items()):
            col = COLORS[c % len(COLORS)]
            upper = [(x0 + xs(p[0]), ys(max(p[k]))) for p in pts]
            lower = [(x0 + xs(p[0]), ys(min(p[k]))) for p in reversed(pts)]
            mean = [(x0 + xs(p[0]), ys(sum(p[k]) / len(p[k]))) for p in pts]
            out.append(f'<polygon points="{fmt(upper + lower)}" fill="{col}" fill-opacity="0.15" stroke="none"/>')
            out.append(f'<polyline points="{fmt(mean)}" fill="none" stroke="{col}" stroke-width="2"/>')
            out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{col}"/>' for a, b in mean]
    for c, (name, runs) in enumerate(series.items()):  # legend
        y = top + h + 40 + 18 * c
        out.append(f'<rect x="{left}" y="{y - 9}" width="14" height="10" fill="{COLORS[c % len(COLORS)]}"/>'
                   f'<text x="{left + 20}" y="{y}">{name}: ' + (f'{len(runs)} runs (line: mean; band: lowest to '
                   'highest run)' if len(runs) > 1 else '1 run') + '</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def read_questions(path, limit=0):
    """FlashRAG JSON lines with `question` (text) and `golden_answers` (a non-empty list of text);
    any other line, or a file without questions, is an error that names the file (and line)."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                r = json.loads(line)
                if not isinstance(r, dict) or "question" not in r or "golden_answers" not in r:
                    raise KeyError("each line needs 'question' and 'golden_answers'")
                q, golds = r["question"], r["golden_answers"]
                if not isinstance(q, str) or not q.strip():
                    raise TypeError(f"question must be non-empty text, not {q!r}")
                q.encode("utf-8")  # a lone surrogate ("\udcff") is valid JSON but not text
                if not isinstance(golds, list) or not golds or not all(isinstance(g, str) for g in golds):
                    raise TypeError(f"golden_answers must be a non-empty list of strings, not {golds!r}")
            except (UnicodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: bad question line ({type(e).__name__}: {e})") from None
            rows.append(r)
            if limit and len(rows) == limit:
                break
    if not rows:
        raise ValueError(f"{path}: no questions in the file")
    return rows


def sign_test(wins_a, wins_b):
    """Exact two-sided sign test of wins_a against wins_b (ties dropped): p."""
    n = wins_a + wins_b
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(wins_a, wins_b) + 1)) / 2 ** n) if n else 1.0


def paired(a, b):
    """(questions only A gets right, only B gets right, the sign test's p) for per-question EM lists of
    one test set: A beats B when it has more of the first (= more right) and p < 0.05."""
    if len(a) != len(b):
        raise ValueError(f"per-question EM of {len(a)} and {len(b)} questions: not the same test set")
    wa, wb = sum(x > y for x, y in zip(a, b)), sum(y > x for x, y in zip(a, b))
    return wa, wb, sign_test(wa, wb)


def token_section(tokenizer, title, rows, scale, legend):
    """One section of `token_page`: rows = [(label, Trajectory, per sampled token its value or None)];
    each token as (its text, sampled, value); values coloured over [-scale, scale]."""
    out = []
    for label, t, values in rows:
        vals = iter(values or [])
        pieces = []  # [ids, sampled, value]: a sampled token, or a run of the environment's tokens
        for x, m in zip(t.tokens[t.prompt_len:], t.loss_mask[t.prompt_len:]):
            if m or not pieces or pieces[-1][1]:
                pieces.append([[x], m, next(vals, None) if m else None])
            else:
                pieces[-1][0].append(x)
        toks = [(tokenizer.decode(ids), m, v) for ids, m, v in pieces]
        out.append(dict(label=label, question=t.question, tokens=toks))
    return dict(title=title, scale=scale, legend=legend, rows=out)


LEGEND_W = ("blue: w > 1, the token takes more of its row's advantage (more credit on a correct row, more blame "
            "on a failed one); red: w < 1, less; grey: the environment's text (documents, messages)")


def credit_sections(tokenizer, batch, group_size, eps, step):
    """tokens.html's sections for a GRPO step's batch (grpo.Batch with the credit's weights): up to two
    groups with both outcomes, each row's tokens coloured by the teacher's weight w - 1."""
    G, out = group_size, []
    for g in range(0, len(batch.trajs), G):
        if len(out) < 2 and any(w is not None for w in batch.weights[g:g + G]):
            rows = [(f"reward {batch.rewards[i]:.0f} | A {batch.advantages[i]:+.2f}" +
                     (" | w = 1 (tau_ref, or A = 0)" if batch.weights[i] is None else ""),
                     batch.trajs[i], None if batch.weights[i] is None else [x - 1 for x in batch.weights[i]])
                    for i in range(g, g + G)]
            out.append(dict(token_section(tokenizer, f"GRPO step {step}: a group's rollouts, w - 1", rows,
                                          eps, LEGEND_W)))
    return out


def token_page(sections):
    """One self-contained HTML page (inline CSS, no script): each section's trajectories, every token
    the policy sampled on a background for its value (blue above 0, red below, white at 0; hover: the
    number), the environment's text (retrieved documents, the invalid-action message) set apart in grey."""
    import html
    css = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;color:#222}"
           ".traj{font-family:monospace;white-space:pre-wrap;border:1px solid #ccc;padding:.6em;margin:.4em 0 1.2em}"
           ".env{color:#888;background:#f4f4f4;display:inline-block;border-left:3px solid #bbb;padding:0 .3em;"
           "font-size:85%}.p{border-radius:2px}")
    out = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>Where the teacher disagrees</title>',
           f"<style>{css}</style></head><body><h1>Where the teacher disagrees</h1>"]
    for sec in sections:
        out.append(f"<h2>{html.escape(sec['title'])}</h2><p>{html.escape(sec['legend'])}</p>")
        for row in sec["rows"]:
            spans = []  # one line: the trajectory's own newlines are its text's (pre-wrap)
            for text, sampled, v in row["tokens"]:
                if not sampled:
                    spans.append(f'<span class="env">{html.escape(text)}</span>')
                    continue
                x = 0.0 if v is None else 0.6 * max(-1.0, min(1.0, v / sec["scale"]))  # 0.6: the text stays legible
                rgb = (int(255 * (1 - x)), int(255 * (1 - x)), 255) if x >= 0 else (255, int(255 * (1 + x)), int(255 * (1 + x)))
                tip = "" if v is None else f' title="{v:+.4f}"'
                spans.append(f'<span class="p" style="background:rgb{rgb}"{tip}>{html.escape(text)}</span>')
            out.append(f"<h3>{html.escape(row['label'])}</h3><p>{html.escape(row['question'])}</p>"
                       f'<div class="traj">{"".join(spans)}</div>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def peak_line():
    """The process's peak memory, one line at the end of a run: resident host memory (Linux's VmHWM
    via getrusage), and the accelerator's allocations where there is one."""
    line = f"peak memory | resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f} GB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        line += f" | cuda {torch.cuda.max_memory_allocated() / 1e9:.2f} GB allocated"
    return line


def eval_line(row):
    s = row["summary"]
    return (f"eval | round {row['round']} {row['after'] if row['after'] != 'start' else 'eval'} | "
            f"EM {s['all']['em']:.3f} | " + " | ".join(f"{k} {v['em']:.3f}" for k, v in s.items() if k != "all") +
            f" | searches {s['all']['searches']:.2f} | format {s['all']['format']:.2f}")


def results_table(results):
    """evolve.py's results table: one row per evaluation of the loop (markdown)."""
    types = [k for k in results[0]["summary"] if k != "all"]
    lines = ["| round | after | GRPO steps | EM | " + " | ".join(types) + " | searches/q | format |",
             "|---|---|---|---|" + "---|" * len(types) + "---|---|"]
    for row in results:
        s = row["summary"]
        lines.append(f"| {row['round']} | {row['after']} (it {row['iteration']}) | {row['grpo_steps']} | "
                     f"{s['all']['em']:.3f} | " + " | ".join(f"{s[t]['em']:.3f}" for t in types) +
                     f" | {s['all']['searches']:.2f} | {s['all']['format']:.2f} |")
    return "\n".join(lines)


def main():
    cfg = dict(DEFAULTS, **configurator.parse(sys.argv[1:], DEFAULTS, __file__, __doc__))
    files = [f for f in cfg["data"].split(",") if f]
    bad = [f"--{k}: required" for k in ("model_dir", "index_dir", "data") if not cfg[k]]
    bad += configurator.check(cfg, positive=("batch", "max_turn_tokens", "max_obs_tokens", "top_k"),
                              not_negative=("limit", "show", "max_turns"),
                              choices=dict(dtype=("auto", "float32", "bfloat16")), dirs=("model_dir", "index_dir"))
    bad += [f"--data={f}: no such file, or empty" for f in files if not (os.path.isfile(f) and os.path.getsize(f) > 0)]
    configurator.refuse(bad)
    data = {path: read_questions(path, cfg["limit"]) for path in files}  # every file, first
    width = Qwen2Config.from_json(os.path.join(base_dir(cfg["model_dir"]), "config.json")).hidden_size
    device, dtype = device_and_dtype(cfg["device"], cfg["dtype"], width)
    check_compile(cfg["compile"], device)
    print(f"{cfg['model_dir']}: {device}, {str(dtype).removeprefix('torch.')}", file=sys.stderr)
    model, tok = load_policy(cfg["model_dir"], device, dtype)  # a checkpoint, or a base and its adapters
    behind_hidden(model)  # each batch's KV cache handed back to the OS before the next
    index = load_index(cfg["index_dir"])
    table, everything = [], []
    for path, qs in data.items():
        res = evaluate(model, tok, index, qs, configurator.group(RolloutConfig, cfg), cfg["batch"])
        name = os.path.splitext(os.path.basename(path))[0]
        for r in res[:cfg["show"]]:
            print(f"\n=== {name}: {r['question']}  gold={r['golden_answers']}  EM={r['em']:.0f}\n{r['trajectory']}")
        for group, s in summarize(res, "type").items():
            table.append((name if group == "all" else f"{name}/{group}", s))
        everything += [dict(r, data=name) for r in res]
    write_atomic(cfg["out_file"], "".join(json.dumps(r) + "\n" for r in everything))
    print("\n| data | n | EM | searches/q | format |\n|---|---|---|---|---|")
    for name, s in table:
        print(f"| {name} | {s['n']} | {s['em']:.3f} | {s['searches']:.2f} | {s['format']:.2f} |")
    sets = [s for name, s in table if "/" not in name]
    print(f"| average | {sum(s['n'] for s in sets)} | {sum(s['em'] for s in sets) / len(sets):.3f} | "
          f"{sum(s['searches'] for s in sets) / len(sets):.2f} | {sum(s['format'] for s in sets) / len(sets):.2f} |")
    print(f"per-question results: {cfg['out_file']}", file=sys.stderr)
    print(peak_line())


if __name__ == "__main__":
    main()
