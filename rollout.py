"""The Search-R1 task: its prompt, its turn, multi-turn search rollouts with loss masks, EM reward.

The question goes into the fixed instruction below, one user message in the checkpoint's own chat
template. The model writes a turn until it closes </search> or </answer>, writes an end-of-turn
token (dropped: not in the tokens, the mask, the log-probs or the KV cache, as Search-R1 decodes
without special tokens) or hits the per-turn cap. The turn's first <search>q</search> or
<answer>a</answer> is its action:
    search  -> "\n\n<information>" + the top-k documents + "</information>\n\n" is appended
               (cut to the observation cap), and the model writes on;
    answer  -> the trajectory ends;
    neither -> the invalid-action message is appended, and the model writes on.
After `max_turns` such turns, one last turn may only answer (a search there is not run).

A trajectory is (tokens, loss_mask, logprobs, ...): loss_mask is 1 exactly where the policy sampled
the token; prompt, observations and injected messages are 0. GRPO and OFSD both use it.
Reward: EM of the last <answer> the model wrote against any gold answer, both normalised (lowercase,
no punctuation or articles, whitespace squeezed); no format reward.

Decoding is generate.decode's; this file hands it the prompts and the turn (`turn_end`). Trajectory
i's k-th token is drawn at u[i, k] of one table of uniforms, so a trajectory does not depend on the
rows beside it or on `rollout_rows`. Left out: paged attention, vLLM.

    python rollout.py CHECKPOINT_DIR INDEX_DIR "Who founded the company that makes the iPhone?"
"""

import re
import string
import sys
from dataclasses import dataclass, field

import torch

import fsdp
import generate
from model import load
from retriever import format_docs

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can call "
    "a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n")
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between "
           "<search> and </search>. If I want to give the final answer, I should put the answer "
           "between <answer> and </answer>. Let me try again.\n")
INFO_OPEN, INFO_CLOSE = "\n\n<information>", "</information>\n\n"
STOP_STRINGS = ("</search>", "</answer>")
ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Search-R1's own settings (train_grpo.sh: max_turns=2, max_response_length and max_obs_length 500,
# retriever.topk 3; its validation runs in the same trainer with them); eval.py's command-line defaults
SEARCH_R1_SETTINGS = dict(max_turns=2, max_turn_tokens=500, max_obs_tokens=500, top_k=3)


def make_prompt(question):
    """Search-R1's user message for a question (stripped, '?' appended when missing)."""
    q = question.strip()
    if not q.endswith("?"):
        q += "?"
    return INSTRUCTION.format(question=q)


def observation(docs):
    """The text appended after a search: Search-R1's information block."""
    return INFO_OPEN + format_docs(docs).strip() + INFO_CLOSE


def extract_answer(model_text):
    """The last <answer>...</answer> the model itself wrote, stripped; None when there is none."""
    found = ANSWER.findall(model_text)
    return found[-1].strip() if found else None


def normalize_answer(s):
    """Search-R1 / SQuAD normalisation: lowercase, drop punctuation and articles, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction, golden_answers):
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    if prediction is None:
        return 0.0
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golden_answers))


def em_rewards(trajs, questions, group_size):
    """R = EM of each trajectory's answer; trajectories are question-major, group_size each."""
    golds = (q["golden_answers"] for q in questions for _ in range(group_size))
    return [exact_match(t.answer, g) for t, g in zip(trajs, golds)]


def max_response_tokens(tokenizer, *, max_turns, max_turn_tokens, max_obs_tokens):
    """The most KV-cache slots a response can take after its prompt: max_turns searching turns and
    the answer-only turn, each up to max_turn_tokens plus the slot of a dropped end-of-turn token,
    and after each searching turn an observation (at most max_obs_tokens) or the invalid-action
    message, whichever is longer. `rollout` sizes its cache with it; evolve.py refuses settings
    whose trajectories could outgrow the model's context with it."""
    env = max(max_obs_tokens, len(tokenizer.encode(INVALID)))
    return (max_turns + 1) * (max_turn_tokens + 1) + max_turns * env


@dataclass
class Trajectory:
    question: str
    prompt_len: int  # tokens[:prompt_len] is the chat-rendered prompt
    tokens: list = field(default_factory=list)  # prompt + response token ids
    loss_mask: list = field(default_factory=list)  # 1 where the policy sampled the token
    logprobs: list = field(default_factory=list)  # log p of each sampled token (0.0 elsewhere)
    queries: list = field(default_factory=list)  # search queries issued, in order
    model_text: str = ""  # everything the policy wrote, concatenated
    answer: str = None  # last <answer> in model_text
    stop: str = ""  # "answer", "final_turn_without_answer"
    n_turns: int = 0

    @property
    def n_search(self):
        return len(self.queries)

    def add(self, ids, sampled, logprobs=None):
        self.tokens += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def render(self, tokenizer):
        """The response as text, each injected span marked [env>> ... <<env]."""
        out, start = [], self.prompt_len
        for i in range(self.prompt_len, len(self.tokens) + 1):
            if i == len(self.tokens) or self.loss_mask[i] != self.loss_mask[start]:
                text = tokenizer.decode(self.tokens[start:i])
                out.append(text if self.loss_mask[start] else f"[env>>{text}<<env]")
                start = i
        return "".join(out)


@torch.no_grad()
def rollout(model, tokenizer, retriever, questions, group_size, *, max_turns, max_turn_tokens,
            max_obs_tokens, top_k, temperature, top_p, generator, contexts=None, rollout_rows=0, search_workers=1,
            compile=False):
    """Run len(questions) x group_size trajectories; returns them question-major (q0 g0, q0 g1, ...).
    `contexts`: text appended to each question's user message (OFSD's teacher view puts tau_ref there).
    `rollout_rows`: decode at most this many trajectories at once (the KV cache's size), 0 = all.
    `search_workers`: processes that share each turn's batch of searches (retriever.Index.search).
    `compile`: decoding steps through torch.compile (generate.compiled)."""
    G, contexts = group_size, contexts or [""] * len(questions)
    with fsdp.gathered(model):  # a sharded model: weights all-gathered once for the whole batch
        # the k-th token trajectory i samples uses u[i, k]: what a row draws does not depend on which
        # rows share its batch or when they stop (so any rollout_rows gives the same trajectories)
        u = None if temperature == 0 else torch.rand(  # (N, the most tokens a trajectory samples)
            len(questions) * G, (max_turns + 1) * max_turn_tokens, generator=generator,
            device=model.model.embed_tokens.weight.device)
        return _rollout(model, tokenizer, retriever, questions, contexts, G, u, rollout_rows=rollout_rows,
                        max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens,
                        top_k=top_k, temperature=temperature, top_p=top_p, search_workers=search_workers,
                        compile=compile)


def _rollout(model, tokenizer, retriever, questions, contexts, G, u, *, rollout_rows, max_turns, max_turn_tokens,
             max_obs_tokens, top_k, temperature, top_p, search_workers, compile=False):
    """`rollout` with u (N, (max_turns + 1) * max_turn_tokens) the trajectories' uniforms."""
    prompts = [tokenizer.encode(tokenizer.chat_prompt(make_prompt(q) + c)) for q, c in zip(questions, contexts)]
    trajs = [Trajectory(q, len(p)) for q, p in zip(questions, prompts) for _ in range(G)]
    for t, p in zip(trajs, (p for p in prompts for _ in range(G))):
        t.add(p, sampled=False)
    invalid_ids = tokenizer.encode(INVALID)

    def turn_end(ended):
        """The Search-R1 turn: answer (done), search (the observation next), neither (the invalid-action
        message next); after max_turns searching turns, the answer-only turn ends the trajectory."""
        nxt, searching = {}, []
        for i, toks, lps, _ in ended:  # an end-of-turn token is never among toks (Search-R1 skips it)
            t, text = trajs[i], tokenizer.decode(toks)
            t.add(toks, sampled=True, logprobs=lps)
            t.model_text += text
            t.n_turns += 1
            t.answer = extract_answer(t.model_text)
            m = ACTION.search(text)  # the first <search>q</search> or <answer>a</answer> of the turn
            if m and m.group(1) == "answer":
                t.stop, nxt[i] = "answer", None
            elif t.n_turns == max_turns + 1:
                t.stop, nxt[i] = "final_turn_without_answer", None
            elif m:
                t.queries.append(m.group(2).strip())
                searching.append(i)
            else:
                nxt[i] = invalid_ids
        if searching:  # one batched call for every row that searches now
            hits = retriever.search([trajs[i].queries[-1] for i in searching], top_k, workers=search_workers)
            for i, h in zip(searching, hits):
                nxt[i] = tokenizer.encode(observation([retriever.doc(d) for d, _ in h]))[:max_obs_tokens]
        for i, ids in nxt.items():
            if ids is not None:
                trajs[i].add(ids, sampled=False)  # loss_mask 0: the environment's tokens
        return nxt

    max_len = max(map(len, prompts)) + max_response_tokens(
        tokenizer, max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_obs_tokens=max_obs_tokens)
    generate.decode(model, tokenizer, prompts, G, turn_end, max_len=max_len, max_turn_tokens=max_turn_tokens,
                    temperature=temperature, top_p=top_p, uniforms=u, rows=rollout_rows, stop_strings=STOP_STRINGS,
                    compile=compile)
    return trajs


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python rollout.py CHECKPOINT_DIR INDEX_DIR QUESTION")
    from retriever import load_index
    policy, tok = load(sys.argv[1])
    (traj,) = rollout(policy, tok, load_index(sys.argv[2]), [sys.argv[3]], 1, temperature=0.0, top_p=1.0,
                      generator=None, **SEARCH_R1_SETTINGS)
    print(traj.render(tok))
    print(f"answer: {traj.answer!r}  searches: {traj.n_search}  stop: {traj.stop}")
