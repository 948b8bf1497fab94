"""Settings on the command line, the same way for every script (nanoGPT's configurator is the model).

A script writes its settings once, as plain lowercase constants at its top, each with a comment:

    lr = 2e-4                      # GRPO AdamW learning rate

and calls `parse(sys.argv[1:], defaults, __file__, __doc__)`: every `--key=value` is typed by its
default (an int is accepted for a float; true/false for a bool; `--key` alone means true for a bool),
a path setting (`*_dir`, `*_file`) has its leading ~ expanded (the shell leaves it alone after `=`),
an unknown key is refused with the list of keys, and `--help` prints every setting with its default
and the comment beside it, read from the script itself. `check` refuses values out of range and
missing paths before the script writes anything, each error naming its key; a settings group (a
dataclass of a method file) checks its own fields with `refuse_bad` when `group` makes it. This
file knows nothing of the method.

    python evolve.py --help
    python eval.py --help
"""

import dataclasses
import math
import os


def group(cls, config, **given):
    """A settings dataclass (rollout.RolloutConfig, grpo.GRPOConfig, ofsd.OFSDConfig) filled from
    `config` by field name, `given` first: the settings a round takes travel as one group. A field
    that is itself a group (GRPOConfig.rollout), when not given, is filled the same way. A group
    checks its own values when made (`refuse_bad`); a bad one stops the script before anything is written."""
    def value(f):
        return given[f.name] if f.name in given else \
            group(f.type, config, **given) if dataclasses.is_dataclass(f.type) else config[f.name]
    try:
        return cls(**{f.name: value(f) for f in dataclasses.fields(cls)
                      if f.name in given or f.name in config or dataclasses.is_dataclass(f.type)})
    except BadSettings as e:
        refuse(e.args[0])


class BadSettings(ValueError):
    """A settings group's values out of range: args[0] lists one line per bad key."""


def refuse_bad(group, positive=(), not_negative=(), choices=None, also=()):
    """A settings group's own check, called when it is made (its __post_init__): its `positive` fields
    > 0, `not_negative` ones >= 0, each of `choices` one of its values, floats finite, and each
    (is_bad, line) of `also`; raises BadSettings naming every bad key."""
    cfg = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    bad = check(cfg, positive, not_negative, choices) + [line for is_bad, line in also if is_bad]
    if bad:
        raise BadSettings(bad)


def settings(namespace):
    """{key: value} of a module's settings: its lowercase public globals of a plain type, in order."""
    return {k: v for k, v in namespace.items() if k.islower() and not k.startswith("_") and
            isinstance(v, (bool, int, float, str))}


def parse(argv, defaults, source, doc, renamed=None):
    """The overrides argv gives, typed by `defaults`; --help prints the settings of `source` and exits.
    renamed: {old key: new key}, each old key refused with its new name."""
    if "--help" in argv or "-h" in argv:
        print(settings_help(defaults, source, doc))
        raise SystemExit(0)
    out = {}
    for arg in argv:
        key, eq, val = arg.removeprefix("--").partition("=")
        if key in (renamed or {}):
            raise SystemExit(f"--{key} is now --{renamed[key]} (the same setting, renamed)")
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
