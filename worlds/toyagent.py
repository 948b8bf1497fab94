"""The toy world's backbone: a scripted search agent, and a tiny Qwen2 warm-started on its
trajectories so that it already speaks the Search-R1 protocol (toyworld.py is the world).

Backbone: a tiny Qwen2 (3 layers, hidden 128, 4 query / 2 key-value heads), a byte-level BPE
tokenizer trained on the world's text plus the chat tokens, warm-started by supervised training
(loss on the agent's tokens only) on trajectories of a scripted agent that uses the real BM25
index and rollout.py's exact prompt, tags and document block. The agent first writes its plan
inside <think> ("I need the city, then the country."), so the number of hops is decided right
after the question, from its wording. Every turn after an observation opens with
<think> and a quote of the evidence (or "Nothing useful was found.", then it searches the entity
by name), so the next move is decided in words after reading. It is imperfect in ways RL and
OFSD can fix: 40% of its multi-hop plans stop after the first hop (the greedy backbone then
answers a bridge question with the bridge entity: the error GRPO finds and fixes first), it
sometimes searches a vague query (a family name alone) and trusts the top document, and it
sometimes checks again, repeating a search before answering correctly (right but wasteful).
A fifth of the warm start's examples show a clean tau_ref in OFSD's teacher wording, which the
agent follows; a reading phase after it shows, in half its examples, a tau_ref as OFSD mines it (a
correct sample of the imperfect agent), which the agent follows move for move: OFSD's teacher view
needs a model that reads a worked example, and a 3-layer model reads one unreliably after the
warm start alone. Both phases sort each pool of examples by length before cutting it into
batches (little padding) and run the last layer's MLP only where there is a loss. The agent
searches with the loop's `top_k`, which the backbone's stamp records: a world built for another
top_k gets a new backbone.

Left out: natural-language variety (templates are fixed), a backbone for real-scale runs (use a
Qwen2.5 checkpoint).

    python -m worlds.toyagent WORLD_DIR [--seed N] [--shipped]     # the world and its backbone (built, or shipped)
    python experiments/backbone.py [--temperature T]        # the backbone's targets, at the loop's settings
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import CHECKPOINT_FILES, Qwen2, Qwen2Config, pad_right, save

from tokenizer import Tokenizer
import index_build
import retriever
from rollout import INFO_CLOSE, INFO_OPEN, INSTRUCTION, INVALID, exact_match, extract_answer, make_prompt, observation
from ofsd import FULL
from checkpoint import write_atomic
from worlds.toyworld import read_jsonl, stamped, write_world

# backbone (tiny Qwen2) and its warm start
BACKBONE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
BACKBONE_VERSION = 5  # bump when the scripted agent or the warm start changes: cached backbones rebuild
VOCAB_SIZE = 3000
SFT_STEPS = 2400
SFT_BATCH = 4
SFT_POOL = 1024  # examples sorted by length together (length-bucketed batches)
SFT_LR = 2e-3
COPY_WEIGHT = 5.0  # loss weight of agent tokens copied from the question or a document
P_EARLY, P_VAGUE, P_REPEAT = 0.4, 0.2, 0.4  # the scripted agent's imperfections
P_PRIVILEGED = 0.2  # share of warm-start examples that show a clean tau_ref trajectory (OFSD's teacher view)
READ_STEPS = 800  # the reading phase, after the warm start: steps whose examples show a sampled tau_ref ...
P_READ = 0.5  # ... in this share of them (the rest: the imperfect agent alone, so its view keeps its skills)
READ_LR = 5e-4
REF_TRIES = 8  # draws of the imperfect agent for a correct tau_ref (else the clean trajectory is shown)
STAMP = "toyworld.json"  # in a backbone folder: the build's version, seed, steps and top_k (written last)
# the backbone for world seed 0 (top_k 3), shipped so that every user starts from the same weights (a
# build is deterministic on one machine, not across machines): version 4's shipped warm start, then
# reading_phase on the project's 2-core machine (docs/toyworld-log.md, 2026-12-01)
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_backbone")
SHIPPED_SHA256 = {
    "config.json": "2b183ca0791fe937707c6911bae12a33b75b3a4cbb33fabe0b87db0e2d6bc86b",
    "model.safetensors": "95d12cdcdab4e501ab7efd29545628254cf0ac0152adcc3f14939ef278270078",
    "tokenizer.json": "424ada53acaa8080f2d958bcfd7e07c272eb47dc24cd1d76ce909040939337bb",
    "tokenizer_config.json": "7b3dab91d4da24872e829154773a5502d91c7e9a96d6317c8130fbd689ed6bb6",
    STAMP: "6b13223fcd862b2e7d2f5e0dbac4419d489bbb69522296d55237b1d33fb7c4f4",
}


# ----------------------------------------------------------------------------------------------
# the scripted agent

CUES = {"city": " was born in the city of ", "year": " was born in the year ",
        "country": " is a city in the country of ", "founder": " was founded by "}
STEP_NAMES = {"city": "the city", "year": "the year", "country": "the country", "founder": "the founder"}
OTHER_YEAR = "the other year"  # a comparison's second step
NOTHING = "Nothing useful was found."  # the agent's quote when no passage states the fact
CHECK = "Let me check again."  # the agent's decision to repeat a search (wasteful)
ANSWER_STEP = "the answer"  # the last step of every plan


def _hop_kinds(q):
    """The relation each hop asks for, in order."""
    text = q["question"]
    if q["type"] == "comparison":
        return ["year", "year"]
    if text.startswith("Who founded"):
        return ["founder"]
    if text.startswith("In which country is the city"):
        return ["country"]
    if q["type"] == "single":
        return ["city"]
    if q["type"] == "bridge":
        return ["founder", "city"] if "founder" in text else ["city", "country"]
    return ["founder", "city", "country"]


def _read(docs, entity, kind, trust_top=False):
    """The agent reads the retrieved documents: (doc number, sentence, value) for the fact `kind`
    of `entity`, from the entity's own passage when retrieved, else (trust_top: the vague agent's
    mistake) from the first passage that states such a fact."""
    order = [i for i, (t, _) in enumerate(docs) if t == entity] + (list(range(len(docs))) if trust_top else [])
    for i in order:
        title, text = docs[i]
        for sentence in text.split(". "):
            if CUES[kind] in sentence:
                sentence = sentence.rstrip(".") + "."
                return i + 1, f"Doc {i + 1}(Title: {title}) {sentence}", sentence.split(CUES[kind])[1].rstrip(".")
    return None, NOTHING, "unknown"


def scripted_turns(q, index, rng, top_k, imperfect=True):
    """Turn texts and observations of the imperfect scripted agent (a turn follows each observation).

    It first writes its plan, the facts it needs in order ("I need the city, then the country."),
    searches the question itself, then each bridge entity by name; after each search it quotes the
    sentence that answers the hop (so a reader sees the evidence) and names the next step of its
    plan ("Next: the country." or "Next: the answer."), and answers with the last value; when the
    entity's passage is not among the results it says so and searches the entity by name. The plan
    puts the hop count right after the question, where the question's wording decides it, instead
    of three hundred tokens later behind an observation. Imperfections: a share P_EARLY of
    multi-hop trajectories plan only the first hop and answer after it; P_VAGUE of first searches
    drop the subject's first word (vague) and read the top passage as the subject's; P_REPEAT of
    searches are repeated once, after a quote and "Let me check again." (every turn after an
    observation opens with <think>, so the next move is always decided in words first)."""
    kinds = _hop_kinds(q)
    early = imperfect and len(kinds) > 1 and q["type"] != "comparison" and rng.random() < P_EARLY
    query = q["question"].rstrip("?")
    vague = imperfect and rng.random() < P_VAGUE
    if vague:  # the subject's first word is left out, and the agent trusts the top passage
        subject = q["hops"][0][0]
        query = query.replace(subject, subject.split(" ", 1)[-1]) if " " in subject else query
    steps = [STEP_NAMES[k] for k in kinds[:1 if early else None]]
    if q["type"] == "comparison":
        steps[1] = OTHER_YEAR
    steps.append(ANSWER_STEP)
    turns, obs = [f"<think> I need {', then '.join(steps[:-1])}. </think>\n"], []
    entity, found = q["hops"][0][0], []
    for h, kind in enumerate(kinds):
        if q["type"] == "comparison":
            entity = q["hops"][h][0]
        repeats = 2 if imperfect and rng.random() < P_REPEAT else 1
        trust = vague and h == 0  # the vague agent reads the top passage as if it were the subject's
        if h > 0 and q["type"] == "comparison":
            query = entity
            if entity in obs[-1]:
                repeats = 0  # both people were in the first results
        for r in range(repeats):
            turns[-1] += f"<search> {query} </search>"
            hits = index.search([query], top_k)[0]
            docs = [index.doc(i) for i, _ in hits]
            obs.append(observation(docs))
            turns.append("")
            if r < repeats - 1:  # a repeat: quote, then decide to check again (every turn opens with <think>)
                turns[-1] += f"<think> {_read(docs, entity, kind, trust)[1]} {CHECK} </think>\n"
        doc_no, quote, value = _read(docs, entity, kind, trust)
        if doc_no is None:  # the entity's passage was not retrieved: search the entity by its name
            turns[-1] += f"<think> {quote} </think>\n<search> {entity} </search>"
            docs = [index.doc(i) for i, _ in index.search([entity], top_k)[0]]
            obs.append(observation(docs))
            turns.append("")
            _, quote, value = _read(docs, entity, kind)
        found.append(value)
        turns[-1] += f"<think> {quote} Next: {steps[h + 1]}. </think>\n"
        if early or q["type"] != "comparison":
            entity = query = value
        if early:
            break
    if q["type"] == "comparison":
        (a, _), (b, _) = q["hops"]
        years = [int(y) if y.isdigit() else 9999 for y in found]
        answer = a if years[0] <= years[1] else b
    else:
        answer = found[-1]
    turns[-1] += f"<answer> {answer} </answer>"
    return turns, obs


# the agent's fixed wording (tokenizer training text; never weighted as a copy)
TEMPLATE_TEXT = (f"<think> I need {', then '.join(STEP_NAMES.values())}, then {OTHER_YEAR}. </think>\n"
                 f"<search> </search> <think> Doc 1(Title: ) {''.join(CUES.values())}. Next: {ANSWER_STEP}. {CHECK} "
                 f"</think>\n<answer> </answer> {NOTHING}")


def _turn_tokens(tokenizer, turns, obs, context, template):
    """Interleave turns and observations -> (ids, weights); `context` collects copyable ids."""
    ids, weight = [], []
    for i, t in enumerate(turns):
        tt = tokenizer.encode(t) + ([tokenizer.eos_ids[0]] if i == len(turns) - 1 else [])
        ids += tt
        weight += [COPY_WEIGHT if x in context and x not in template else 1.0 for x in tt]
        if i < len(obs):
            o = tokenizer.encode(obs[i])
            ids += o
            weight += [0.0] * len(o)
            context |= set(o)
    return ids, weight


def scripted_tokens(tokenizer, q, index, rng, top_k, reference=None):
    """Token ids and per-token loss weights of one scripted trajectory: 0 on the prompt and the
    observations; on the agent's own tokens 1, or COPY_WEIGHT where the agent copies a word from
    the question or a document (names, years): the skill a tiny model is slowest to pick up.

    reference="clean" or "sampled": the prompt also shows a reference trajectory in OFSD's teacher
    wording (ofsd.FULL, the "full" context), and the agent follows it move for move, so the backbone reads
    privileged context the way an instruct model reads a worked example (OFSD's teacher relies on
    that). "clean": the clean scripted trajectory;
    "sampled": what OFSD's mining shows, a correct sample of the imperfect agent (drawn until one is
    correct; vague, repeated or checked-again searches included), as a rollout records it (no
    end-of-turn id)."""
    template = set(tokenizer.encode(TEMPLATE_TEXT)) | set(tokenizer.eos_ids)  # never weighted as copies
    context = set(tokenizer.encode(q["question"]))
    message = make_prompt(q["question"])
    if reference:
        for _ in range(REF_TRIES if reference == "sampled" else 0):
            turns, obs = scripted_turns(q, index, rng, top_k)
            if exact_match(extract_answer(turns[-1]), q["golden_answers"]):
                break
        else:
            turns, obs = scripted_turns(q, index, rng, top_k, imperfect=False)
        ref_ids = _turn_tokens(tokenizer, turns, obs, set(), template)[0]
        if reference == "sampled":  # as a rollout records it; the warm start's clean references keep
            ref_ids = ref_ids[:-1]  # version 4's final <|im_end|>, so that phase builds version 4's weights
        message += FULL.format(tau_ref=tokenizer.decode(ref_ids))
        context |= set(ref_ids)
    else:
        turns, obs = scripted_turns(q, index, rng, top_k)
    prompt = tokenizer.encode(tokenizer.chat_prompt(message))
    ids, weight = _turn_tokens(tokenizer, turns, obs, context, template)
    return prompt + ids, [0.0] * len(prompt) + weight


# ----------------------------------------------------------------------------------------------
# the backbone

def _warm_start(model, data, steps, lr, rng, desc):
    """`steps` AdamW steps of weighted cross-entropy on the agent's tokens, batches of SFT_BATCH from
    `data`, warm-up then cosine. Length-bucketed batches: each pool of SFT_POOL examples is sorted by
    length and cut into batches (little padding); the batches are then shuffled."""
    order = list(range(len(data)))
    rng.shuffle(order)
    batches = []
    for p in range(0, len(order), SFT_POOL):
        pool = sorted(order[p:p + SFT_POOL], key=lambda i: len(data[i][0]))
        batches += [pool[j:j + SFT_BATCH] for j in range(0, len(pool), SFT_BATCH)]
    rng.shuffle(batches)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))  # warm-up, cosine
        batch = [data[i] for i in batches[step]]
        ids, valid = pad_right([x for x, _ in batch])  # (B, T) each
        weight = torch.zeros(ids.shape)
        for i, (_, w) in enumerate(batch):
            weight[i, :len(w)] = torch.tensor(w)
        target = weight[:, 1:] > 0  # the agent's tokens
        h = model.hidden(ids[:, :-1], valid=valid[:, :-1], select=target)  # (n, d) only where there is a loss
        logits = F.linear(h, model.lm_head_weight)  # (n, V)
        w = weight[:, 1:][target]
        loss = (F.cross_entropy(logits, ids[:, 1:][target], reduction="none") * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def reading_phase(model, tok, index, train, seed, top_k, steps=READ_STEPS):
    """The second phase of the warm start (`steps`): in P_READ of its examples the prompt shows a
    sampled tau_ref, as OFSD's teacher view does, and the agent repeats its moves; the rest are the
    imperfect agent alone, so the student view keeps its skills. After the first phase alone the
    3-layer model reads a privileged context unreliably (single-hop questions answered right 1.00
    without tau_ref, 0.61 with it). Seeded on its own, so it can run on any warm start."""
    rng = random.Random(seed + 11)
    data = [scripted_tokens(tok, train[rng.randrange(len(train))], index, rng, top_k,
                            reference="sampled" if rng.random() < P_READ else None)
            for _ in range(steps * SFT_BATCH)]
    _warm_start(model, data, steps, READ_LR, rng, "backbone reading phase")


def build_backbone(world_dir, out_dir, seed, top_k, steps=SFT_STEPS, read_steps=READ_STEPS):
    """Train the tokenizer and the tiny Qwen2: the warm start on scripted trajectories (`steps`),
    then the reading phase (`read_steps`); save it."""
    torch.manual_seed(seed)
    rng = random.Random(seed + 2)
    index = retriever.load_index(os.path.join(world_dir, "index"))
    train = read_jsonl(os.path.join(world_dir, "train.jsonl"))
    corpus = [json.loads(line)["contents"] for line in open(os.path.join(world_dir, "corpus.jsonl"))]
    texts = corpus + [INSTRUCTION, INVALID, INFO_OPEN + "Doc 1(Title: x) y" + INFO_CLOSE,
                      TEMPLATE_TEXT] * 20
    texts += [q["question"] for q in train]
    tmp = out_dir.rstrip("/") + ".build"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok = Tokenizer.train(texts, VOCAB_SIZE, os.path.join(tmp, "tokenizer.json"))
    model = Qwen2(Qwen2Config(vocab_size=VOCAB_SIZE, **BACKBONE))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    data = [scripted_tokens(tok, train[i % len(train)], index, rng, top_k,
                            reference="clean" if rng.random() < P_PRIVILEGED else None)
            for i in range(steps * SFT_BATCH)]  # a fresh trajectory for every example seen
    _warm_start(model, data, steps, SFT_LR, rng, "backbone warm start")
    reading_phase(model, tok, index, train, seed, top_k, read_steps)
    save(model, tok, out_dir, also={STAMP})  # temp folder + rename
    stamp = dict(version=BACKBONE_VERSION, seed=seed, steps=steps, read_steps=read_steps, top_k=top_k)
    write_atomic(os.path.join(out_dir, STAMP), json.dumps(stamp))  # written last: marks a finished build
    shutil.rmtree(tmp)


def ensure(world_dir, seed, top_k, world_only=False, use_shipped=True):
    """The toy world in world_dir (and its backbone in world_dir/backbone), built once, reused; a
    world or backbone from another seed, another BACKBONE_VERSION or top_k, or an unfinished build
    is rebuilt. The backbone the repository ships (SHIPPED) is copied in instead of a build when it
    fits (use_shipped; its files' hashes checked), so every user starts from the same weights."""
    backbone = os.path.join(world_dir, "backbone")
    if not (stamped(os.path.join(world_dir, "world.json"), seed=seed)
            and stamped(os.path.join(world_dir, "index", "meta.json"), format=index_build.FORMAT_VERSION)):
        t0 = time.time()
        write_world(world_dir, seed)
        print(f"toy world written to {world_dir} in {time.time() - t0:.0f}s", file=sys.stderr)
    stamp = dict(version=BACKBONE_VERSION, seed=seed, top_k=top_k)
    if not world_only and not stamped(os.path.join(backbone, STAMP), **stamp):
        t0 = time.time()
        if use_shipped and stamped(os.path.join(SHIPPED, STAMP), **stamp):
            install_shipped(backbone)
            print(f"toy backbone copied from {SHIPPED} (hashes checked)", file=sys.stderr)
        else:
            build_backbone(world_dir, backbone, seed, top_k)
            print(f"toy backbone written to {backbone} in {time.time() - t0:.0f}s", file=sys.stderr)
    return world_dir, backbone


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def install_shipped(backbone):
    """Copy the shipped backbone to `backbone` (temp folder, then rename) after checking every
    file against SHIPPED_SHA256; a file that does not match is an error naming it."""
    for name, want in SHIPPED_SHA256.items():
        got = file_sha256(os.path.join(SHIPPED, name))
        if got != want:
            raise ValueError(f"{os.path.join(SHIPPED, name)}: sha256 {got}, expected {want} (a damaged "
                             "checkout? `git checkout worlds/toy_backbone` restores it)")
    tmp = backbone.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(SHIPPED, tmp)
    if os.path.isdir(backbone):
        if not set(os.listdir(backbone)) <= CHECKPOINT_FILES | {STAMP}:
            raise ValueError(f"{backbone}: holds files that are not a backbone's; nothing was changed")
        shutil.rmtree(backbone)
    os.replace(tmp, backbone)


def main():
    ap = argparse.ArgumentParser(description="the toy world and its backbone: built from the code, or the shipped one")
    ap.add_argument("world_dir")
    ap.add_argument("--seed", type=int, default=0)
    with open(os.path.join(SHIPPED, STAMP)) as f:
        shipped_top_k = json.load(f)["top_k"]
    ap.add_argument("--top_k", type=int, default=shipped_top_k, help="documents per search of the scripted agent: "
                    "the loop's top_k (default: the shipped backbone's)")
    ap.add_argument("--shipped", action="store_true", help="copy the repository's backbone where it fits "
                    "(what evolve.py does) instead of building it from the code")
    args = ap.parse_args()
    world_dir, backbone = ensure(args.world_dir, args.seed, args.top_k, use_shipped=args.shipped)
    print(f"world: {world_dir}\nbackbone: {backbone}")


if __name__ == "__main__":
    main()
