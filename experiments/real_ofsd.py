"""One OFSD round on a checkpoint, each clip mode against the RFT control and no round at all, over
mining seeds: the experiment docs/ablation.md declares for the real 0.5B (#34 items 3 and 4).

For each mining seed s: `--questions` train questions drawn with random.Random(s), G rollouts each
at the loop's sampling settings (a generator seeded s), one pair mined per question with a correct
sample (ofsd.mine, the paper's rule), and the round's diagnostics before (ofsd.mined_diagnostics:
greedy EM on the mined questions from the teacher and the student view, disagreement, true KL by
segment). Then each arm, from a fresh copy of the checkpoint, on exactly those pairs:
    none-round     no round: the checkpoint itself, evaluated on every draw (never a copy)
    ofsd-<clip>    ofsd.distill with ofsd_clip = vocab, position or none, the adapter merged
    rft            the same LoRA round minimising the NLL of tau_ref's own policy tokens in the
                   student view, each pair's mean over its tokens (rejection-sampling fine-tuning:
                   learning from the successful sibling without a teacher), the adapter merged
    rft-kl         rft's NLL plus --kl_weight times the plain forward KL (ofsd_clip "none") from the
                   teacher view, on the pairs with both a tau_ref token and a loss position
The teacher view of every arm and diagnostic is what --ofsd_context shows (ofsd.privileged), the
distillation's positions what --ofsd_positions names; a row records both.
and after it greedy EM on the mined questions (from the student and the teacher view) and on the
first `--test` test questions, which no arm mines or trains on (per type, searches per question).
The weights are float32 with bfloat16 compute where `--dtype=auto` picks it (FSDP2 on one rank, as
evolve.py). Every arm of a seed starts its adapter from the same torch seed.

Prints one line per arm and seed, each round's diagnostics before -> after, the table (mean
[lowest, highest draw]) and the margin rule of the earlier rounds (docs/ablation.md): arm A gains
over B only if A's mean test EM beats B's by more than the larger range over draws, or A's worst
draw beats B's best. The paired rule declared for the P-lora arms (a sign test per draw) is
experiments/verdict.py's, over the same rows. A draw is a (policy, mining seed) pair: `--policy`
names this checkpoint in the tables and its rows, and `--earlier` adds rows of draws on other
policies to the tables, the rule and the chart. Writes a JSON line per arm and seed to --out and a
chart (test EM per arm, a dot per draw). Run again with the same --out once every row is there, it
prints the tables and the chart without computing.

Resumable: each seed's mined pairs and their diagnostics go to OUT.pairs-seed<s>.json (or the file
--pairs names, where another run's pairs are read: experiments/context.py's) as soon as they exist,
a teacher view's diagnostics on pairs mined without it to <pairs file>.before-<context>.json (13
minutes a draw on one core of the 0.5B), and a run given the same --out skips the (seed, arm) rows
already there and reads both back instead of computing them again (mining a seed takes about 40
minutes on 2 cores; a LoRA round of the real 0.5B about 40). The LoRA rounds recompute each decoder
layer in backward (`--activation_checkpointing`, on by default): without it one step of 4 pairs of
1,000 / 2,000 tokens peaks at 13.0 GB and the real round was killed at 24.4 GB; with it 6.8 GB.

Left out: the alternating loop (evolve.py runs it), more than one round.

    python experiments/real_ofsd.py --checkpoint runs/grpo05/checkpoint/model --seeds 0,1,2 \\
        --max_turn_tokens=200 --top_p=0.95 --rollout_rows=160 --out runs/real_ofsd.jsonl
"""

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (PROTOCOL, cell, distill_round, machine, mined_pairs, policy, provenance,  # noqa: E402
                    saved_diagnostics, stats)
from rollout import RolloutConfig, rollout  # noqa: E402
from eval import evaluate, read_questions, summarize  # noqa: E402
from evolve import DEFAULTS  # noqa: E402  (the loop's settings as written)
import fsdp  # noqa: E402
import ofsd  # noqa: E402
import retriever  # noqa: E402
import teacher_gap  # noqa: E402
from worlds import toyagent  # noqa: E402
from model import Qwen2Config  # noqa: E402
import checkpoint  # noqa: E402

ARMS = ("none-round", "ofsd-vocab", "ofsd-position", "ofsd-none", "rft", "rft-kl")
VIEW = ("ofsd_context", "ofsd_positions")  # what the teacher sees, where the KL counts
ROUND = ("ofsd_lora_rank", "ofsd_lora_alpha", "ofsd_lora_lr", "ofsd_epochs", "ofsd_pairs_per_step", "tau_clip", "max_grad_norm", "kl_chunk")


def test_em(model, tok, index, test, protocol, batch):
    """(the summary by type, each test question's EM in order: what a paired rule compares), greedy."""
    results = evaluate(model, tok, index, test, protocol, batch)
    return summarize(results, "type"), [r["em"] for r in results]


def verdict(name, em, other, base):
    margin = max(max(em) - min(em), max(base) - min(base))
    gain = stats(em)[0] - stats(base)[0] > margin or min(em) > max(base)
    return (f"  {name} over {other}: {stats(em)[0]:.3f} against {stats(base)[0]:.3f}, difference "
            f"{stats(em)[0] - stats(base)[0]:+.3f}, margin {margin:.3f}; worst draw {min(em):.3f} vs best "
            f"{max(base):.3f}: {'GAIN' if gain else 'no gain'}")


def draw(row):
    """A row's draw, (policy, mining seed): the policy is named where rows of several policies meet."""
    return f"({row['policy']}, {row['seed']})" if row.get("policy") else str(row["seed"])


def rounds_table(rows):
    """Each round's diagnostics, one line per draw and arm (a value before -> after the round)."""
    def num(v):
        return "-" if v is None else f"{v:.3f}"

    def moved(r, before, after):
        return f"{num(r.get(before))} -> {num(r.get(after))}"
    out = ["| draw | arm | true KL | P(teacher's top) | clip_frac | mined EM, student view | mined EM, teacher view "
           "| mined searches/q, student / teacher view | P(search), student / teacher view | test EM "
           "| test searches/q | minutes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = dict(r["before"], **r["round"])
        if r["arm"] == "none-round":
            d.update(mined_em_after=d.get("student_em"), teacher_em_after=d.get("teacher_em"),
                     student_searches_after=d.get("student_searches"), teacher_searches_after=d.get("teacher_searches"))
        out.append(f"| {draw(r)} | {r['arm']} | {moved(d, 'kl_true_before', 'kl_true_after')} "
                   f"| {moved(d, 'p_top_before', 'p_top_after')} | {num(d.get('clip_frac_after'))} "
                   f"| {moved(d, 'student_em', 'mined_em_after')} | {moved(d, 'teacher_em', 'teacher_em_after')} "
                   f"| {moved(d, 'student_searches', 'student_searches_after')} / "
                   f"{moved(d, 'teacher_searches', 'teacher_searches_after')} "
                   f"| {num(d.get('p_search_student'))} / {num(d.get('p_search_teacher'))} "
                   f"| {r['test']['all']['em']:.3f} | {r['test']['all']['searches']:.2f} | {r['seconds'] / 60:.0f} |")
    return "\n".join(out)


def chart_svg(ems, draws):
    """Test EM per arm, a dot per draw (in `draws`' order, left to right) and a bar at the mean, as an
    SVG string written by hand. ems = {arm: {draw: test EM}}."""
    W, H, left, top, bottom = 120 + 110 * len(ems), 275, 50, 20, 55
    y = lambda v: top + (1 - v) * (H - top - bottom)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<line x1="{left}" y1="{y(0)}" x2="{W - 10}" y2="{y(0)}" stroke="black"/>']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<text x="{left - 30}" y="{y(v) + 4}">{v:.2f}</text>'
                   f'<line x1="{left}" y1="{y(v)}" x2="{W - 10}" y2="{y(v)}" stroke="#ddd"/>')
    for i, (arm, by_draw) in enumerate(ems.items()):
        x = left + 50 + 110 * i
        mean = stats(list(by_draw.values()))[0]
        out.append(f'<line x1="{x - 25}" y1="{y(mean)}" x2="{x + 25}" y2="{y(mean)}" stroke="#1f77b4" stroke-width="3"/>')
        out += [f'<circle cx="{x - 20 + 40 * k / max(1, len(draws) - 1)}" cy="{y(by_draw[d])}" r="3" fill="#d62728"/>'
                for k, d in enumerate(draws) if d in by_draw]
        out.append(f'<text x="{x - 30}" y="{H - 35}">{arm}</text>')
    out.append(f'<text x="{left}" y="{H - 20}">greedy test EM after one round; bar: mean over draws</text>')
    out.append(f'<text x="{left}" y="{H - 5}">dots, left to right: the draws {", ".join(draws)}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def label(row):
    """A row's arm, with its teacher view and loss positions where they are not the paper's."""
    view = (row.get("ofsd_context", "full"), row.get("ofsd_positions", "policy"))
    weight = f" w={row['kl_weight']:g}" if row.get("kl_weight") else ""
    return row["arm"] + ("" if view == ("full", "policy") or row["arm"] == "none-round" else f" [{'/'.join(view)}]") + weight


def report(rows, arms, chart=""):
    """The tables, the declared rule's verdict on test EM and the chart, over every draw in rows;
    an arm run with another teacher view is its own arm (`label`)."""
    rows = [dict(r, arm=label(r)) for r in rows]
    arms = list(dict.fromkeys([a for a in arms if any(r["arm"] == a for r in rows)] + [r["arm"] for r in rows]))
    print("\n" + rounds_table(rows))
    types = sorted({t for r in rows for t in r["test"] if t != "all"})
    print("\n| arm | test EM | " + " | ".join(types) + " | searches/q | mined EM after | teacher view after |")
    print("|---|---|" + "---|" * len(types) + "---|---|---|")
    by_draw = {arm: {draw(r): r["test"]["all"]["em"] for r in rows if r["arm"] == arm} for arm in arms}
    ems = {arm: list(v.values()) for arm, v in by_draw.items()}  # an arm's test EM, one per draw
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        after = [cell([r["round"].get(f"{name}_after", r["before"].get(before)) for r in rs])  # none-round: before
                 for name, before in (("mined_em", "student_em"), ("teacher_em", "teacher_em"))]
        print(f"| {arm} | {cell(ems[arm])} | " + " | ".join(cell([r["test"][t]["em"] for r in rs]) for t in types)
              + f" | {cell([r['test']['all']['searches'] for r in rs])} | {after[0]} | {after[1]} |")
    print("\nthe margin rule of the earlier rounds (docs/ablation.md), on test EM; the paired rule, declared for\n"
          "the P-lora arms, is experiments/verdict.py over the same rows:")
    for arm in arms:
        for other in ("rft", "none-round"):
            if arm not in ("rft", "none-round") and other in ems:
                print(verdict(arm, ems[arm], other, ems[other]))
    if "rft" in ems and "none-round" in ems:
        print(verdict("rft", ems["rft"], "none-round", ems["none-round"]))
    if chart:
        draws = list(dict.fromkeys(draw(r) for r in rows))  # in the rows' order
        with open(chart, "w") as f:
            f.write(chart_svg(by_draw, draws))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="the policy the round starts from (a model folder)")
    ap.add_argument("--seeds", default="0,1,2", help="mining seeds, comma-separated")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--world_dir", default=DEFAULTS["world_dir"])
    ap.add_argument("--questions", type=int, default=128, help="train questions rolled out to mine, per seed")
    ap.add_argument("--test", type=int, default=128, help="held-out test questions (the first N)")
    ap.add_argument("--group_size", type=int, default=DEFAULTS["group_size"])
    for k in PROTOCOL + ("eval_batch",) + ROUND:
        ap.add_argument(f"--{k}", type=type(DEFAULTS[k]), default=DEFAULTS[k])
    for k in VIEW:
        ap.add_argument(f"--{k}", default=DEFAULTS[k])
    ap.add_argument("--kl_weight", type=float, default=0.0, help="rft-kl: the weight of the KL beside the NLL")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--activation_checkpointing", default="true", choices=("true", "false"),
                    help="recompute each decoder layer in backward in the LoRA rounds (memory; the same math)")
    ap.add_argument("--out", default="", help="JSON lines, one per arm and seed")
    ap.add_argument("--pairs", default="", help="each seed's pairs file, {seed} in its name (default: OUT.pairs-seed{seed}.json)")
    ap.add_argument("--chart", default="", help="an SVG chart of test EM per arm")
    ap.add_argument("--policy", default="", help="the checkpoint's name in the tables, kept in each row it writes")
    ap.add_argument("--recompute_diagnostics", action="store_true",
                    help="recompute a diagnostics file that another CPU computed (else read it and say so)")
    ap.add_argument("--earlier", nargs="*", default=[],
                    help="JSON lines of earlier draws (other policies), counted in the tables, the rule and the chart")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if set(arms) - set(ARMS):
        sys.exit(f"unknown arms {sorted(set(arms) - set(ARMS))}; known: {', '.join(ARMS)}")
    if args.ofsd_context not in ofsd.CONTEXTS or args.ofsd_positions not in ofsd.POSITIONS:
        sys.exit(f"--ofsd_context must be one of {', '.join(ofsd.CONTEXTS)}, --ofsd_positions one of "
                 f"{', '.join(ofsd.POSITIONS)}")
    if "rft-kl" in arms and not args.kl_weight > 0:
        sys.exit("arm rft-kl needs --kl_weight > 0 (declared before the run)")
    world_dir, _ = toyagent.ensure(args.world_dir, DEFAULTS["world_seed"], DEFAULTS["top_k"])
    index = retriever.load_index(os.path.join(world_dir, "index"))
    train = read_questions(os.path.join(world_dir, "train.jsonl"))
    test = read_questions(os.path.join(world_dir, "test.jsonl"), args.test)
    width = Qwen2Config.from_json(os.path.join(checkpoint.base_dir(args.checkpoint), "config.json")).hidden_size
    _, _, dev, dt = fsdp.setup("auto", args.dtype, width)
    rollout_args = RolloutConfig(**{k: getattr(args, k) for k in PROTOCOL})
    round_args = {k: getattr(args, k) for k in ROUND + VIEW}
    context = args.ofsd_context
    print(f"{args.checkpoint} | {dt} | {torch.get_num_threads()} threads | {len(test)} test questions "
          f"| {rollout_args} | {round_args}", flush=True)
    recompute = args.activation_checkpointing == "true"
    rows = [json.loads(line) for line in open(args.out)] if args.out and os.path.exists(args.out) else []
    view = (args.ofsd_context, args.ofsd_positions)
    done = {(r["seed"], r["arm"]) for r in rows  # a resumed run skips these (none-round: any view)
            if r["arm"] == "none-round" or (r.get("ofsd_context", "full"), r.get("ofsd_positions", "policy")) == view}
    for seed in [int(s) for s in args.seeds.split(",")]:
        if all((seed, arm) in done for arm in arms):
            continue

        def mine_them():
            model, tok = policy(args.checkpoint, dev, dt)
            questions = random.Random(seed).sample(train, min(args.questions, len(train)))
            mined = ofsd.mine(rollout(model, tok, index, [q["question"] for q in questions], args.group_size, rollout_args,
                                      torch.Generator(device=dev).manual_seed(seed)), questions, args.group_size)
            before = teacher_gap.before_round(model, tok, index, mined, rollout_args, args.kl_chunk, context)
            return mined, dict(before, context=context, machine=machine())

        pairs_file = args.pairs.format(seed=seed) if args.pairs else args.out and f"{args.out}.pairs-seed{seed}.json"
        mined, before, seconds = mined_pairs(pairs_file, mine_them)
        if mined and (not before or before.get("context", "full") != context):  # pairs mined without this
            # teacher view's diagnostics (another view's, or none: experiments/context.py's pairs files),
            # computed once and kept beside the pairs file for every later run with this view
            def diagnose():
                model, tok = policy(args.checkpoint, dev, dt)
                return dict(teacher_gap.before_round(model, tok, index, mined, rollout_args, args.kl_chunk, context),
                            context=context)
            before = saved_diagnostics(pairs_file and f"{pairs_file}.before-{context}.json", diagnose,
                                       args.recompute_diagnostics)
        print(f"seed {seed} | mined {len(mined)} of {min(args.questions, len(train))} | teacher_em "
              f"{before.get('teacher_em')} | student_em {before.get('student_em')} | p_search teacher "
              f"{before.get('p_search_teacher')} | student {before.get('p_search_student')} | {seconds:.0f}s", flush=True)
        for arm in [a for a in arms if (seed, a) not in done]:
            t1 = time.time()
            model = None  # one model at a time: the last arm's goes before the next is read
            fsdp.trim_host_memory()
            model, tok = policy(args.checkpoint, dev, dt, recompute)  # every arm from the checkpoint as written
            torch.manual_seed(seed)  # the adapter's initialisation, the same for every arm of a seed
            log = lambda epoch, n, loss: print(  # noqa: E731
                f"seed {seed} | {arm} | epoch {epoch} | step {n:4d} | loss {loss:.5f} | {time.time() - t1:.0f}s", flush=True)
            if arm != "none-round":  # rft: tau_ref's NLL (ofsd_loss nll); rft-kl: plus the plain KL (nll_kl)
                loss, clip = dict(rft=("nll", "none"), **{"rft-kl": ("nll_kl", "none")}).get(arm, ("kl", arm[5:]))
                cfg = ofsd.OFSDConfig(ofsd_questions=args.questions, group_size=args.group_size, ofsd_students="any",
                                      ofsd_loss=loss, ofsd_kl_weight=args.kl_weight, ofsd_clip=clip,
                                      rollout=rollout_args, **round_args)
                m = distill_round(model, tok, mined, cfg, seed, log=log)
            else:
                m = {}
            if arm != "none-round" and mined:
                for view, name in (("student", "mined_em_after"), ("teacher", "teacher_em_after")):
                    em, searches = teacher_gap.greedy_scores(model, tok, index, mined, rollout_args,
                                                             context if view == "teacher" else None)
                    m.update(teacher_gap.split_em(name, em, mined), **{f"{view}_searches_after": sum(searches) / len(mined)})
            summary, by_question = test_em(model, tok, index, test, rollout_args, args.eval_batch)
            training = None if arm == "none-round" else dict(
                {k: getattr(args, k) for k in ROUND}, steps=len(m.get("losses", [])), activation_checkpointing=recompute)
            row = dict(policy=args.policy, seed=seed, arm=arm, mined=len(mined), before=before, test=summary,
                       test_from="evaluated", made=provenance(args.checkpoint, pairs_file, training),
                       **{k: getattr(args, k) for k in VIEW}, kl_weight=args.kl_weight if arm == "rft-kl" else None,
                       test_em_by_question=by_question,
                       round={k: v for k, v in m.items() if k != "losses"}, losses=m.get("losses", []),
                       seconds=time.time() - t1)
            rows.append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"seed {seed} | {arm} | test EM {summary['all']['em']:.3f} | searches {summary['all']['searches']:.2f} "
                  f"| mined_em_after {m.get('mined_em_after')} | teacher_em_after {m.get('teacher_em_after')} "
                  f"| kl_true {m.get('kl_true_before')} -> {m.get('kl_true_after')} | {row['seconds']:.0f}s", flush=True)
    earlier = [json.loads(line) for f in args.earlier for line in open(f)]
    report(earlier + [dict(r, policy=r.get("policy") or args.policy) for r in rows], arms, args.chart)

if __name__ == "__main__":
    main()
