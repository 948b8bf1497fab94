"""Settings on the command line, the same way for every script (nanoGPT's configurator is the model).

A script writes its settings once, as plain lowercase constants at its top, each with a comment:

    lr = 2e-4                      # GRPO AdamW learning rate

and calls `parse(sys.argv[1:], defaults, __file__, __doc__)`: every `--key=value` is typed by its
default (an int is accepted for a float; true/false for a bool; `--key` alone means true for a bool),
a path setting (`*_dir`, `*_file`) has its leading ~ expanded (the shell leaves it alone after `=`),
an unknown key is refused with the list of keys, and `--help` prints every setting with its default
and the comment beside it, read from the script itself. `check` refuses values out of range and
missing paths before the script writes anything, each error naming its key. evolve.py's own checks
(each setting's range, the ranks, the context a trajectory needs) are at the end.

    python evolve.py --help
    python eval.py --help
"""

import dataclasses
import math
import os

import ofsd
from clipped_kl import CLIPS
from rollout import RolloutConfig, make_prompt, max_response_tokens


def group(cls, config, **given):
    """A settings dataclass (rollout.RolloutConfig, grpo.GRPOConfig, ofsd.OFSDConfig) filled from
    `config` by field name, `given` first: the settings a round takes travel as one group. A field
    that is itself a group (GRPOConfig.rollout), when not given, is filled the same way."""
    def value(f):
        return given[f.name] if f.name in given else \
            group(f.type, config, **given) if dataclasses.is_dataclass(f.type) else config[f.name]
    return cls(**{f.name: value(f) for f in dataclasses.fields(cls)
                  if f.name in given or f.name in config or dataclasses.is_dataclass(f.type)})


def settings(namespace):
    """{key: value} of a module's settings: its lowercase public globals of a plain type, in order."""
    return {k: v for k, v in namespace.items() if k.islower() and not k.startswith("_") and
            isinstance(v, (bool, int, float, str))}


def parse(argv, defaults, source, doc):
    """The overrides argv gives, typed by `defaults`; --help prints the settings of `source` and exits."""
    if "--help" in argv or "-h" in argv:
        print(settings_help(defaults, source, doc))
        raise SystemExit(0)
    out = {}
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in defaults:
            raise SystemExit(f"unknown argument {arg!r}; keys: {', '.join(defaults)} (--help says what each does)")
        old = defaults[key]
        if isinstance(old, bool):
            if val.lower() not in ("", "true", "1", "false", "0"):
                raise SystemExit(f"--{key} takes true/false, not {val!r}")
            out[key] = val.lower() in ("", "true", "1")
            continue
        if not eq:
            raise SystemExit(f"--{key} needs a value: --{key}=...")
        try:
            out[key] = type(old)(val)  # int("1") for an int, float("1") for a float, str
        except ValueError:
            raise SystemExit(f"--{key}={val}: expected {type(old).__name__}") from None
        if key.endswith(("_dir", "_file")):
            out[key] = os.path.expanduser(out[key])
    return out


def settings_help(defaults, source, doc):
    """Every setting with its default and its comment (and the comment's continuation lines), read
    from the constants block of `source`, the one place each is written."""
    lines, key = [doc.split("\n\n")[0], "", f"usage: python {os.path.basename(source)} [--key=value ...]; the settings:"], None
    with open(os.path.abspath(source)) as f:
        for line in f:
            name, eq, rest = line.partition(" = ")
            if eq and name in defaults:
                key = name
                lines.append(f"  --{name}={defaults[name]}".ljust(33) + " " + rest.partition("# ")[2].rstrip())
            elif key and line.lstrip().startswith("# ") and line.startswith(" "):
                lines.append(" " * 34 + line.strip()[2:])
            elif key:
                key = None
    return "\n".join(lines)


def check(cfg, positive=(), not_negative=(), choices=None, dirs=(), files=()):
    """Errors (one line each, naming the key) for values out of range and paths that are not there:
    non-finite floats, `positive` keys <= 0, `not_negative` keys < 0, a value outside its `choices`,
    a non-empty `dirs` setting that is no directory, a non-empty `files` setting that is no non-empty file."""
    bad = [f"--{k}={v}: must be a finite number" for k, v in cfg.items() if isinstance(v, float) and not math.isfinite(v)]
    bad += [f"--{k}={cfg[k]}: must be > 0" for k in positive if not cfg[k] > 0]
    bad += [f"--{k}={cfg[k]}: must be >= 0" for k in not_negative if not cfg[k] >= 0]
    bad += [f"--{k}={cfg[k]!r}: must be one of {', '.join(v)}" for k, v in (choices or {}).items() if cfg[k] not in v]
    bad += [f"--{k}={cfg[k]}: no such directory" for k in dirs if cfg[k] and not os.path.isdir(cfg[k])]
    bad += [f"--{k}={cfg[k]}: no such file, or empty" for k in files
            if cfg[k] and not (os.path.isfile(cfg[k]) and os.path.getsize(cfg[k]) > 0)]
    return bad


def refuse(bad):
    """Stop before anything is written when there are errors."""
    if bad:
        raise SystemExit("bad settings, nothing was written:\n  " + "\n  ".join(bad))


# ---------------------------------------------------------------------------------------------
# evolve.py's checks: each setting in its range, the ranks, the context, before anything is written

POSITIVE = ("grpo_lora_alpha", "grpo_lora_lr", "grpo_steps", "questions_per_step", "ppo_mini_batch", "micro_batch",
            "warmup_steps", "max_turn_tokens", "max_obs_tokens", "top_k", "ofsd_questions", "lora_rank", "lora_epochs",
            "ofsd_micro_batch", "eval_batch", "kl_chunk", "lr", "lora_lr", "lora_alpha", "clip_ratio", "max_grad_norm",
            "temperature", "tau_clip", "search_workers")
NOT_NEGATIVE = ("ofsd_kl_weight", "grpo_lora_rank", "iterations", "max_turns", "test_limit", "kl_coef", "entropy_coef",
                "seed", "world_seed", "rollout_rows")
CHOICES = dict(ofsd_loss=ofsd.LOSSES, kl_policy=("round", "initial"), ofsd_students=("any", "incorrect"),
               ofsd_clip=CLIPS,
               ofsd_context=ofsd.CONTEXTS, ofsd_positions=ofsd.POSITIONS, dtype=("auto", "float32", "bfloat16"))

def check_evolve(cfg):
    """Refuse a setting out of its range before anything is written; the error names the key."""
    bad = check(cfg, POSITIVE, NOT_NEGATIVE, CHOICES, dirs=("model_dir", "index_dir"),
                             files=("train_file", "test_file"))
    if cfg["group_size"] < 2:
        bad.append(f"--group_size={cfg['group_size']}: must be >= 2 (a group of one has no advantage "
                   "and gives no OFSD pair)")
    if cfg["ppo_mini_batch"] > cfg["questions_per_step"]:
        bad.append(f"--ppo_mini_batch={cfg['ppo_mini_batch']}: must be at most --questions_per_step="
                   f"{cfg['questions_per_step']}")
    if cfg["grpo_lora_rank"] and cfg["kl_policy"] == "initial" and cfg["iterations"] > 1:
        bad.append(f"--kl_policy=initial with --grpo_lora_rank={cfg['grpo_lora_rank']}: a LoRA round's KL model is "
                   "the policy with its adapter off, the round's own start; after the first round's merge the "
                   "initial model is gone (use --kl_policy=round, or --iterations=1)")
    if not 0 < cfg["top_p"] <= 1:
        bad.append(f"--top_p={cfg['top_p']}: must be in (0, 1]")
    if not (cfg["device"] in ("auto", "cpu", "cuda") or cfg["device"].startswith("cuda:")):
        bad.append(f"--device={cfg['device']!r}: must be auto, cpu, cuda or cuda:N")
    refuse(bad)


def check_compile(compile, device, world_size=1):
    """--compile=true is for one process on CUDA: on a CPU the compiled step measured no faster and a
    run's changing cache shapes make it compile again and again (docs/benchmarks.md)."""
    if compile and (str(device).split(":")[0] != "cuda" or world_size > 1):
        raise SystemExit(f"--compile=true is for one process on a CUDA device (CUDA graphs); this run is on "
                         f"{device} with {world_size} rank(s): on a CPU the compiled decoding step is no faster "
                         "(docs/benchmarks.md), and a sharded model's gathered weights are not what it traced")


def check_ranks(cfg, world_size, ppo_updates):
    """Every rank needs questions, and the same number of training passes."""
    q, n = cfg["questions_per_step"], cfg["ofsd_questions"]
    if q % world_size or q // world_size < ppo_updates or n < world_size:
        raise SystemExit(f"--questions_per_step={q} must be a multiple of the number of ranks ({world_size}) "
                         f"with at least one question per rank for each of its {ppo_updates} updates, and "
                         f"--ofsd_questions={n} at least the number of ranks: every rank needs questions, "
                         "and the same number of training passes")


def max_context_tokens(tokenizer, context, response, group_size):
    """At most how many tokens ofsd.privileged adds for a response of at most `response` tokens:
    the framing and tau_ref's response ("full", "no_answer"; a query list is shorter than the
    response it came from, whose observations it leaves out), or every sibling's ("group_queries",
    a few tokens more a line for its mark)."""
    framing = {"full": ofsd.FULL, "no_answer": ofsd.NO_ANSWER, "queries": ofsd.QUERIES,
               "group_queries": ofsd.GROUP_QUERIES}[context]
    mark = len(tokenizer.encode("\n- incorrect: " + ofsd.NO_SEARCH))
    return len(tokenizer.encode(framing)) + (group_size * (response + mark) if context == "group_queries" else response)


def check_context(cfg, model_config, tokenizer, longest_question):
    """A trajectory must fit the model's context: the longest question's prompt, then its response
    (rollout.max_response_tokens: the KV cache holds all of it); OFSD's teacher view holds the
    privileged text (max_context_tokens) and the response. Refused before any weights or caches
    are allocated."""
    prompt = len(tokenizer.encode(tokenizer.chat_prompt(make_prompt(longest_question))))
    response = max_response_tokens(tokenizer, group(RolloutConfig, cfg))
    view = f"teacher view ({cfg['ofsd_context']})" if cfg["ofsd_rounds"] else "trajectory"
    extra = max_context_tokens(tokenizer, cfg["ofsd_context"], response, cfg["group_size"]) \
        if cfg["ofsd_rounds"] else 0
    longest = prompt + extra + response
    if longest > model_config.max_position_embeddings:
        raise SystemExit(
            f"bad settings, nothing was written:\n  a {view} may reach {longest:,} tokens (a prompt of {prompt}"
            f"{f', a privileged context of up to {extra:,}' if extra else ''} and a response of up to {response:,}: "
            f"--max_turns={cfg['max_turns']} searching turns and the answer-only turn of --max_turn_tokens="
            f"{cfg['max_turn_tokens']} + 1, and --max_turns observations of --max_obs_tokens={cfg['max_obs_tokens']}),"
            f" over the model's context of {model_config.max_position_embeddings:,} (max_position_embeddings)")
