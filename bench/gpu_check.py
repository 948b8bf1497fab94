"""One command that checks the CUDA path on a lent GPU: prints one table, writes a JSON file.

Sections (each row: what was run, the numbers, ok or not):
  loss        the Triton kernel against the float64 spec, each clip mode, float32 and bfloat16
              inputs, odd N and V: max error of the loss and the gradient; then time and peak
              memory of the spec, chunked, Triton and fused paths at a 3B shape (8,192 positions,
              d 2,048, V 151,936; the spec only where it fits)
  generate    tokens/s of generate.generate (batched KV-cache decode, bfloat16, random weights) at
              the 0.5B and 3B shapes, batch 64 and 256, 512-token prompts, 256 new tokens, its
              prefill time, eager and compiled (`compile`: CUDA graphs; the compiled step's logits
              against the eager step's, teacher-forced), against transformers' generate on the same
              weights and prompts, eager and with its static cache (which it compiles);
              then the 0.5B's decoding step under torch.profiler (the top operators by self time,
              and the share of the step the GPU was busy)
  loop        evolve.py's real path on the device: one GRPO step (16 questions x 5) and one OFSD
              round in bfloat16 mixed precision (FSDP2, one rank) on the toy world's questions,
              with the checkpoint given (--checkpoint or QWEN_CHECKPOINT; else the toy backbone),
              peak memory against bench_memory's state formula; the row fails unless the round
              mined pairs (so it distilled) and nothing is NaN
  nccl        the same loop on two ranks over NCCL, when the machine has two GPUs (else skipped)
Each section stops at its time limit (--limits, about 9 minutes in all on a GPU, looser under
--smoke; a row says so) and prints its rows as they finish. `--smoke` runs every section on CPU at
tiny shapes (the kernel under TRITON_INTERPRET=1, the loop on the toy backbone in bfloat16 on one
gloo rank) in a few minutes; a test runs it, so the script cannot rot between GPU visits. Without
Triton the kernel's rows are skipped, the reason printed.

    python bench/gpu_check.py --out gpu_check.json [--checkpoint DIR]      # on a GPU, ~9 minutes
    python bench/gpu_check.py --smoke --out /tmp/smoke.json                # anywhere
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors (before triton is imported)

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import clipped_kl  # noqa: E402
import fsdp  # noqa: E402
import generate  # noqa: E402
import model  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from common import SIZES, n_params, state_formula  # noqa: E402  (bench/common.py)
from test_clipped_kl import grad_bound, row_kl, tau_between  # noqa: E402  (the tests' bounds, one definition)

DEV = fsdp.device_and_dtype("cpu" if SMOKE else "cuda", "float32", 0)[0]  # "cuda:0": the index torch needs
NO_TRITON = "skipped: Triton is not installed (requirements.txt installs it on Linux x86-64 only)"
NO_COMPILER = generate.compile_missing() and "skipped: " + generate.compile_missing()
GiB = 2 ** 30


def sync():
    if DEV != "cpu":
        torch.cuda.synchronize()


def peak_reset():
    if DEV != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / GiB if DEV != "cpu" else None


def timed(fn, repeats=2):
    """(best wall seconds, peak GiB on CUDA) of fn() over `repeats` runs."""
    best, peak = float("inf"), None
    for _ in range(repeats):
        peak_reset()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        peak = peak_gib()
    return best, peak


# ----------------------------------------------------------------------------------------------
# the loss

def loss_rows():
    rows = []
    g = torch.Generator().manual_seed(0)
    for clip in clipped_kl.CLIPS if clipped_kl.triton is not None else ():
        for dtype in (torch.float32, torch.bfloat16):
            n, v = (13, 3001) if SMOKE else (257, 151_937)
            s = (torch.randn(n, v, generator=g) * 3).to(dtype)
            t = (torch.randn(n, v, generator=g) * 3).to(dtype)
            tau = 0.002 if clip == "vocab" else tau_between(row_kl(s, t))  # "position": about half clipped
            s64 = s.double().requires_grad_(True)
            want = clipped_kl.clipped_forward_kl_spec(s64, t.double(), tau, clip)
            (g_want,) = torch.autograd.grad(want, s64)
            x = s.to(DEV).requires_grad_(True)
            got = clipped_kl.clipped_forward_kl(x, t.to(DEV), tau, clip, use_triton=True)
            (g_got,) = torch.autograd.grad(got, x)
            loss_err = abs(got.item() - want.item())
            err = (g_got.double().cpu() - g_want).abs()
            worst = (err / grad_bound(g_want, dtype, n)).max().item()  # <= 1: within the tests' bound everywhere
            ok = loss_err <= 1e-5 * max(1.0, abs(want.item())) and worst <= 1 and bool(g_want.any())
            rows.append(dict(section="loss", what=f"triton vs float64, clip={clip}, {str(dtype)[6:]}, N={n} V={v}",
                             loss_err=loss_err, grad_max_err=err.max().item(), grad_err_over_bound=worst, ok=ok))
    if clipped_kl.triton is None:
        rows.append(dict(section="loss", what="Triton kernel vs float64, each clip mode", note=NO_TRITON, ok=True))
    N, d, V = (64, 32, 1031) if SMOKE else (8192, SIZES["3B"]["hidden_size"], SIZES["3B"]["vocab_size"])
    dt = torch.float32 if SMOKE else torch.bfloat16
    hs = torch.randn(N, d, device=DEV, dtype=dt)
    ht = torch.randn(N, d, device=DEV, dtype=dt)
    w = torch.randn(V, d, device=DEV, dtype=dt) * 0.02
    zt = (ht @ w.T).contiguous()

    def logits_path(fn):
        def run():
            x = hs.clone().requires_grad_(True)
            fn(x @ w.T).backward()
        return run

    paths = [("spec (autograd, several (N, V))", logits_path(lambda z: clipped_kl.clipped_forward_kl_spec(z, zt, 0.05))),
             ("chunked PyTorch", logits_path(lambda z: clipped_kl.clipped_forward_kl(z, zt, 0.05, use_triton=False))),
             ("Triton kernel", logits_path(lambda z: clipped_kl.clipped_forward_kl(z, zt, 0.05, use_triton=True))),
             ("fused from hidden states", lambda: clipped_kl.fused_linear_clipped_kl(
                 hs.clone().requires_grad_(True), ht, w, 0.05, chunk=1024).backward())]
    for name, fn in paths:
        if name == "Triton kernel" and clipped_kl.triton is None:
            rows.append(dict(section="loss", what=name, note=NO_TRITON, ok=True))
            continue
        try:
            sec, peak = timed(fn)
            rows.append(dict(section="loss", what=f"{name}, N={N} d={d} V={V} {str(dt)[6:]}", seconds=sec,
                             peak_gib=peak, ok=True))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append(dict(section="loss", what=f"{name}, N={N} d={d} V={V}", note="out of memory", ok=True))
    return rows


# ----------------------------------------------------------------------------------------------
# generation

def random_model(cfg, dtype):
    torch.manual_seed(0)
    m = model.Qwen2(model.Qwen2Config(**cfg)).to(DEV, dtype)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not n.endswith("norm.weight"):
                p.normal_(0, 0.02)
    return m.eval()


def generate_rows(tmp, emit):
    import transformers
    tok = Tokenizer.train(["the search engine returns documents"] * 10, 300, os.path.join(tmp, "tok.json"))
    tiny = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True)
    shapes = {"tiny": tiny} if SMOKE else {"0.5B": SIZES["0.5B"], "3B": SIZES["3B"]}
    batches, prompt_len, new = ((2, 4), 16, 8) if SMOKE else ((64, 256), 512, 256)
    dt = torch.bfloat16
    torch._dynamo.config.recompile_limit = 64  # a compile per shape and model here, more than the default 8
    # batch 256 of each shape first (the targets' rows), each model made afresh (its own peak)
    for b, (shape, cfg) in [(b, x) for b in sorted(batches, reverse=True) for x in shapes.items()]:
        ours = random_model(dict(cfg, rope_theta=1e6), dt)
        folder = os.path.join(tmp, shape)
        model.save(ours, tok, folder)
        ref = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=dt).to(DEV).eval()
        prompts = torch.randint(0, cfg["vocab_size"], (b, prompt_len), generator=torch.Generator().manual_seed(b))
        p = prompts.to(DEV)

        def ours_run(n, compile=False):
            return generate.generate(ours, tok, prompts.tolist(), n, stop_ids=[], compile=compile)[0]

        def ref_run(static=False):
            with torch.no_grad():
                return ref.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=new,
                                    min_new_tokens=new, eos_token_id=None, pad_token_id=0,
                                    **(dict(cache_implementation="static") if static else {}))
        what = f"{shape} batch {b}, prompt {prompt_len}, {new} new, bfloat16"
        prefill, _ = timed(lambda: ours_run(1), repeats=1)
        sec, peak = timed(lambda: ours_run(new), repeats=1)
        emit(dict(section="generate", what=what, tokens_per_s=b * new / sec, prefill_s=prefill, peak_gib=peak,
                  ok=True))
        if shape == next(iter(shapes)) and b == max(batches):  # where an eager step's time goes, before
            emit(profile_row(ours, tok, b, prompt_len, shape))  # the compiles that may use up the limit
        if NO_COMPILER:
            emit(dict(section="generate", what=what + ", compiled", note=NO_COMPILER, ok=True))
            sec_c = float("nan")
        else:
            t0 = time.perf_counter()
            ours_run(new, compile=True)  # the first compiled call compiles
            first = time.perf_counter() - t0
            sec_c, peak = timed(lambda: ours_run(new, compile=True), repeats=1)
            err, scale, agree = compiled_vs_eager(ours, prompts.tolist())
            emit(dict(section="generate", what=what + ", compiled", tokens_per_s=b * new / sec_c, peak_gib=peak,
                      compile_s=first, teacher_forced_logits_max_err=err,
                      logits_max=scale, argmax_agree=agree, ok=err <= 0.05 * scale))
        ref_sec, ref_peak = timed(ref_run, repeats=1)
        emit(dict(section="generate", what=what + ", transformers", transformers_tokens_per_s=b * new / ref_sec,
                  transformers_peak_gib=ref_peak, ours_compiled_over_transformers=ref_sec / sec_c, ok=True))
        if not SMOKE and not NO_COMPILER:  # with a static cache on CUDA, transformers' generate compiles
            ref_run(static=True)  # its forward (CUDA graphs) on the first call
            ref_sec, ref_peak = timed(lambda: ref_run(static=True), repeats=1)
            emit(dict(section="generate", what=what + ", transformers static cache compiled",
                      transformers_tokens_per_s=b * new / ref_sec, transformers_peak_gib=ref_peak,
                      ours_compiled_over_transformers=ref_sec / sec_c, ok=True))
        ours = ref = None  # freed before the next shape
        if DEV != "cpu":
            torch.cuda.empty_cache()
    return []


def compiled_vs_eager(ours, prompts, steps=8):
    """Teacher-forced, the compiled decoding step against the eager one: the prompts prefilled into two
    caches, each step fed the eager logits' greedy tokens. (max |logit difference|, max |logit|, share
    of rows and steps whose argmax agrees): greedy sampling of random bfloat16 weights, whose logits
    nearly tie, parts at the first rounding difference, so equal tokens are no test there."""
    n, max_len = len(prompts), generate.round_up(len(prompts[0]) + steps + 1, generate.CACHE_STEP)  # as decode's
    caches = [generate.new_cache(ours, n, max_len) for _ in range(2)]
    for t in (caches[1].k, caches[1].v, caches[1].end) if DEV != "cpu" else ():
        torch._dynamo.mark_static_address(t)
    with torch.no_grad():
        eager = [generate.extend(ours, c, prompts) for c in caches][0]  # (n, V)
        w = torch.ones(n, dtype=torch.bool, device=DEV)
        err = scale = agree = 0.0
        for i in range(steps):
            tok = eager.argmax(-1)  # (n,)
            span = min(generate.round_up(len(prompts[0]) + i + 1, generate.SPAN_STEP), max_len)
            eager = generate.decode_step(ours, caches[0].upto(span), tok, w)  # (n, V)
            comp = generate.compiled(torch.device(DEV).type)(ours, caches[1].upto(span), tok, w).clone()
            err = max(err, (comp - eager).abs().max().item())
            scale = max(scale, eager.abs().max().item())
            agree += (comp.argmax(-1) == eager.argmax(-1)).float().mean().item() / steps
    return err, scale, agree


def profile_row(ours, tok, b, prompt_len, shape, steps=16):
    """The eager decoding step under torch.profiler: the top operators by self time (CUDA's when on
    a GPU) over `steps` steps of `b` rows, and how busy the GPU was (its kernels' time / wall time)."""
    from torch.profiler import ProfilerActivity, profile
    prompts = torch.randint(0, ours.config.vocab_size, (b, prompt_len), generator=torch.Generator().manual_seed(0))
    generate.generate(ours, tok, prompts.tolist(), 2, stop_ids=[])  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV != "cpu" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        generate.generate(ours, tok, prompts.tolist(), steps, stop_ids=[])
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_device_time_total" if DEV != "cpu" else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:6]
    busy = sum(e.self_device_time_total for e in events) / 1e6 / wall if DEV != "cpu" else None
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]  # where the host's time goes
    return dict(section="profile", what=f"{shape} decode, batch {b}, prompt {prompt_len}, {steps} steps, eager",
                wall_s=wall, gpu_busy=busy, top=", ".join(f"{e.key} {getattr(e, key) / 1e3:.1f}ms x{e.count}"
                                                         for e in top),
                host_top=", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f}ms x{e.count}" for e in host), ok=True)


# ----------------------------------------------------------------------------------------------
# the loop: evolve.py on the device, one and two ranks

def loop_rows(tmp, checkpoint):
    world = os.path.join(tmp, "toyworld")
    subprocess.run([sys.executable, "-m", "worlds.toyagent", world, "--shipped"], cwd=ROOT, check=True, capture_output=True)
    # a policy that answers some questions right, so the OFSD round mines pairs and distils: the real
    # checkpoint when given (2 turns of 200 tokens, 500-token observations), else the toy backbone at
    # the toy world's own protocol (evolve.py's defaults)
    ckpt = checkpoint if checkpoint and not SMOKE else os.path.join(world, "backbone")
    protocol = ["--max_turns=2", "--max_turn_tokens=200", "--max_obs_tokens=500"] if ckpt == checkpoint else []
    q, g = (8, 3) if SMOKE else (16, 5)
    args = [f"--model_dir={ckpt}", f"--index_dir={world}/index", f"--train_file={world}/train.jsonl",
            f"--test_file={world}/test.jsonl", "--test_limit=8", "--iterations=1", "--grpo_steps=1",
            f"--questions_per_step={q}", f"--ppo_mini_batch={q // 2}", f"--group_size={g}", f"--ofsd_questions={q}",
            "--dtype=bfloat16", *protocol, "--micro_batch=4", "--ofsd_epochs=1"]
    P = n_params(model.Qwen2Config.from_json(os.path.join(ckpt, "config.json")))
    rows = []
    for ranks in (1, 2):
        if ranks == 2 and (SMOKE or torch.cuda.device_count() < 2):
            rows.append(dict(section="nccl", what="2 ranks over NCCL", note="skipped: fewer than 2 GPUs", ok=True))
            continue
        out = os.path.join(tmp, f"run{ranks}")
        launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        "--nproc_per_node=2"]
        code = ("import sys, torch, evolve; sys.argv = ['evolve.py'] + sys.argv[1:]; evolve.main(); "
                "print('PEAK_GIB', torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else -1)")
        t0 = time.perf_counter()
        p = subprocess.run(launcher + (["-c", code] if ranks == 1 else ["evolve.py"]) + args +
                           [f"--out_dir={out}", f"--device={DEV}"], cwd=ROOT, capture_output=True, text=True)
        sec = time.perf_counter() - t0
        if p.returncode:
            rows.append(dict(section="loop" if ranks == 1 else "nccl", what=f"{ranks} rank(s)", ok=False,
                             note=p.stderr[-1500:]))
            continue
        metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        step = next(m for m in metrics if m["kind"] == "grpo_step")
        ofsd_round = next(m for m in metrics if m["kind"] == "ofsd_round")
        peak = float(p.stdout.split("PEAK_GIB")[-1]) if "PEAK_GIB" in p.stdout else None
        predicted = sum(state_formula(P, ranks).values()) / GiB  # weights, gradients, AdamW, the KL model
        rows.append(dict(section="loop" if ranks == 1 else "nccl",
                         what=f"{ranks} rank(s): GRPO step {q}x{g} + OFSD round, bfloat16, {os.path.basename(ckpt)}",
                         seconds=sec, grpo_loss=step["loss"], grpo_tokens=step["tokens"], ofsd_pairs=ofsd_round["pairs"],
                         peak_gib=peak if peak is None or peak >= 0 else None, predicted_state_gib=predicted,
                         ok=all(map(lambda x: x == x, (step["loss"], step["grad_norm"]))) and ofsd_round["pairs"] > 0,
                         **({} if ofsd_round["pairs"] else dict(note="no pair mined: the OFSD round distilled nothing"))))
    return rows


def fmt(row):
    keys = [k for k in row if k not in ("section", "what", "ok")]
    cells = ", ".join(f"{k} {row[k]:.4g}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in keys
                      if row[k] is not None and k != "note") + (f" ({row['note'][:200]})" if "note" in row else "")
    return f"| {row['section']} | {row['what']} | {cells} | {'ok' if row['ok'] else 'FAIL'} |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="every section on CPU at tiny shapes (minutes)")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--checkpoint", default=os.environ.get("QWEN_CHECKPOINT", ""))
    ap.add_argument("--sections", default="loss,generate,loop")
    ap.add_argument("--limits", default="loss=100,generate=200,loop=200" if SMOKE else "loss=50,generate=400,loop=70",
                    help="seconds each section may take: on a GPU its budget; under --smoke a guard against a hang "
                         "(a 2-core CPU running something beside it takes 2-3x the time alone)")
    args = ap.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU check")
    rows, t0 = [], time.time()
    device = "CPU (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"gpu_check on {device}, torch {torch.__version__}\n\n| section | what | numbers | ok |\n|---|---|---|---|",
          flush=True)

    def emit(row):  # each row printed as it finishes: a section cut short keeps what it measured
        rows.append(row)
        print(fmt(row), flush=True)

    class OutOfTime(BaseException):  # not an Exception: nothing in a section catches it (Triton's interpreter would)
        pass

    def out_of_time(*_):
        raise OutOfTime

    signal.signal(signal.SIGALRM, out_of_time)
    limits = {k: int(v) for k, v in (x.split("=") for x in args.limits.split(","))}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("loss", loss_rows), ("generate", lambda: generate_rows(tmp, emit)),
                         ("loop", lambda: loop_rows(tmp, args.checkpoint))):
            if name in args.sections.split(","):
                t1 = time.time()
                signal.alarm(limits[name])
                try:
                    for row in fn():
                        emit(row)
                except OutOfTime:
                    emit(dict(section=name, what=f"stopped at its {limits[name]} s limit", ok=False))
                except Exception as e:  # a section that breaks is a failed row; the next section still runs
                    emit(dict(section=name, what="raised", note=f"{type(e).__name__}: {str(e)[:300]}", ok=False))
                finally:
                    signal.alarm(0)
                print(f"  {name}: {time.time() - t1:.0f}s", file=sys.stderr, flush=True)
    print(f"\n{time.time() - t0:.0f}s")
    with open(args.out + ".tmp", "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, smoke=SMOKE, rows=rows), f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
