"""The Search-R1 task: its prompt, its turn, multi-turn search rollouts with loss masks, EM reward.

The question goes into the instruction below, one user message in the chat template. The model
writes a turn until it closes </search> or </answer> (an end-of-turn token is dropped, as Search-R1
decodes without special tokens) or hits the turn cap; the turn's first tag pair is its action:
    search  -> "\n\n<information>" + the top-k documents + "</information>\n\n" (observation cap)
    answer  -> the trajectory ends
    neither -> the invalid-action message is appended
and the model writes on; after `max_turns` such turns one last turn may only answer.
A trajectory is (tokens, loss_mask, logprobs, ...): loss_mask is 1 exactly where the policy sampled
the token (prompt, observations, injected messages: 0), for GRPO and OFSD alike (`pad_batch`: as
tensors). Reward: EM of the last <answer> against any gold answer, both normalised as SQuAD.

Decoding is generate.decode's: this file hands it the prompts and `turn_end`. Left out: vLLM, format rewards.

    python rollout.py CHECKPOINT_DIR INDEX_DIR "Who founded the company that makes the iPhone?"
"""

import re
import string
import sys
from dataclasses import dataclass, field, replace

import torch

import generate
from configurator import refuse_bad
from model import load, pad_right
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


@dataclass(frozen=True)
class RolloutConfig:
    """How a rollout runs the task (evolve.py's constants of these names; the defaults are greedy)."""
    max_turns: int  # searching turns before the answer-only turn
    max_turn_tokens: int  # per-turn response cap
    max_obs_tokens: int  # observation cap
    top_k: int  # documents per search
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling
    rollout_rows: int = 0  # trajectories decoded at once (the KV cache's rows); 0 = all
    search_workers: int = 1  # processes sharing a turn's searches
    compile: bool = False  # decoding steps through torch.compile

    def __post_init__(self):
        refuse_bad(self, positive=("max_turn_tokens", "max_obs_tokens", "top_k", "search_workers"),
                   not_negative=("max_turns", "rollout_rows", "temperature"),
                   also=[(not 0 < self.top_p <= 1, f"--top_p={self.top_p}: must be in (0, 1]")])

    def greedy(self):
        """The same rollouts without sampling (evaluations)."""
        return replace(self, temperature=0.0, top_p=1.0)


SEARCH_R1 = RolloutConfig(max_turns=2, max_turn_tokens=500, max_obs_tokens=500, top_k=3)  # Search-R1's: eval.py's defaults

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


def max_response_tokens(tokenizer, cfg):
    """The most KV-cache slots a response can take: every turn at its cap plus a dropped end-of-turn
    token, and after each searching turn the longer of an observation and the invalid-action message."""
    env = max(cfg.max_obs_tokens, len(tokenizer.encode(INVALID)))
    return (cfg.max_turns + 1) * (cfg.max_turn_tokens + 1) + cfg.max_turns * env


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


def pad_batch(trajs, pad_id, device):
    """Trajectories right-padded -> ids, valid, loss_mask and the rollout's log-probs, (B, T) each."""
    ids, valid = pad_right([t.tokens for t in trajs], pad_id, device)
    mask = pad_right([t.loss_mask for t in trajs], 0, device)[0].bool()
    old = torch.zeros(ids.shape, device=device)
    for i, t in enumerate(trajs):
        old[i, :len(t.logprobs)] = torch.tensor(t.logprobs, device=device)
    return ids, valid, mask, old


@torch.no_grad()
def rollout(model, tokenizer, retriever, questions, group_size, cfg, generator=None, contexts=None, uniforms=None):
    """len(questions) x group_size trajectories, question-major. `contexts`: text appended to each
    user message (OFSD's teacher view). Trajectory i samples its k-th token at uniforms[i, k] (default:
    from `generator`): the rows beside it and cfg.rollout_rows change nothing."""
    G, contexts = group_size, contexts or [""] * len(questions)
    u = uniforms
    if u is None and cfg.temperature > 0:  # (N, most sampled tokens)
        u = torch.rand(len(questions) * G, (cfg.max_turns + 1) * cfg.max_turn_tokens, generator=generator,
                       device=model.model.embed_tokens.weight.device)
    prompts = [tokenizer.encode(tokenizer.chat_prompt(make_prompt(q) + c)) for q, c in zip(questions, contexts)]
    trajs = [Trajectory(q, len(p)) for q, p in zip(questions, prompts) for _ in range(G)]
    for t, p in zip(trajs, (p for p in prompts for _ in range(G))):
        t.add(p, sampled=False)
    invalid_ids = tokenizer.encode(INVALID)

    def turn_end(ended):
        """The Search-R1 turn for each row that ended one: {row: the tokens to append, None: done}."""
        nxt, searching = {}, []
        for i, toks, lps, _ in ended:
            t, text = trajs[i], tokenizer.decode(toks)
            t.add(toks, sampled=True, logprobs=lps)
            t.model_text += text
            t.n_turns += 1
            t.answer = extract_answer(t.model_text)
            m = ACTION.search(text)  # the turn's first <search>q</search> or <answer>a</answer>
            if m and m.group(1) == "answer":
                t.stop, nxt[i] = "answer", None
            elif t.n_turns == cfg.max_turns + 1:
                t.stop, nxt[i] = "final_turn_without_answer", None
            elif m:
                t.queries.append(m.group(2).strip())
                searching.append(i)
            else:
                nxt[i] = invalid_ids
        if searching:  # one batched call for every row that searches now
            hits = retriever.search([trajs[i].queries[-1] for i in searching], cfg.top_k, workers=cfg.search_workers)
            for i, h in zip(searching, hits):
                nxt[i] = tokenizer.encode(observation([retriever.doc(d) for d, _ in h]))[:cfg.max_obs_tokens]
        for i, ids in nxt.items():
            if ids is not None:
                trajs[i].add(ids, sampled=False)  # loss_mask 0: the environment's tokens
        return nxt

    max_len = max(map(len, prompts)) + max_response_tokens(tokenizer, cfg)
    turns = generate.Turns(max_len, cfg.max_turn_tokens, cfg.temperature, cfg.top_p, cfg.rollout_rows, STOP_STRINGS,
                           compile=cfg.compile)
    generate.decode(model, tokenizer, prompts, G, turn_end, turns, u)
    return trajs


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python rollout.py CHECKPOINT_DIR INDEX_DIR QUESTION")
    from retriever import load_index
    policy, tok = load(sys.argv[1])
    (traj,) = rollout(policy, tok, load_index(sys.argv[2]), [sys.argv[3]], 1, SEARCH_R1)
    print(traj.render(tok))
    print(f"answer: {traj.answer!r}  searches: {traj.n_search}  stop: {traj.stop}")
