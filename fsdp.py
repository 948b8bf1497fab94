"""Devices, sharding and mixed precision with PyTorch's FSDP2: the one place that picks the device
and compute dtype (`device_and_dtype`, `setup`) and lays the policy out on ranks.

When the run is distributed (torchrun) or trains whole weights in bfloat16 (the default on CUDA,
and on a CPU with native bfloat16 arithmetic for a real checkpoint; one process included),
evolve.py passes the policy and the KL term's model through `shard`:
    fully_shard(each decoder layer), then fully_shard(the root: embeddings, final norm, LM head)
    MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=float32)
so every rank holds 1/N of every float32 parameter, and AdamW's moments only for that slice
(float32 master weights and optimizer state); a layer's weights are all-gathered in the compute
dtype just before it runs and freed after it, and gradients are reduce-scattered in float32.
The GRPO loss is already divided by the token count of all ranks, so gradients are summed over
ranks, not averaged. On one CPU process in float32 (the toy main job) nothing is sharded and
every helper below falls through to the plain model; one process that trains only LoRA adapters
holds its frozen base in the compute dtype (`wrap`), half float32's bytes and no gathering.

Generation is many small forward passes: `behind_hidden`, installed by `shard` and `wrap`, all-gathers
the weights at a decode's first forward (one with a KV cache), keeps them through every step, and
frees them at the next forward without a cache: the method's files call the model and never fsdp.py.
Checkpoints: `full_state_dict` gathers the model on rank 0 (written in Hugging Face format), the
optimizer is saved per rank with torch.distributed.checkpoint (`save_optimizer` / `load_optimizer`).
`state_bytes` reports what each rank holds. `trim_host_memory` hands the memory glibc keeps freed
back to the OS (after each checkpoint, each decoding batch, each cast of the weights, and on a CPU
before each decoder layer that runs with gradients: `wrap`'s `trim_each_layer`); on a CPU the kernel caches
oneDNN and ideep keep per matmul shape are bounded (`MATMUL_SHAPES`), or a run grows round after round.
`teardown` leaves the process group, a distributed process's last call.

Left out: CPU offload of parameters or optimizer state, tensor or sequence parallelism, hybrid
sharding across nodes (a 2-D device mesh), float8.

    torchrun --nproc_per_node=8 evolve.py ...          # evolve.py calls shard() when distributed
    python -m pytest tests/test_fsdp.py                 # 2 gloo ranks on CPU against 1 process
"""

import contextlib
import ctypes
import os
import time
import types

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor


BF16_MIN_HIDDEN = 512  # CPU bfloat16 only for layers this wide: every Qwen2.5 (896+); the toy's 128 stays float32


def cpu_has_native_bf16():
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX on x86, BF16 on Arm), read
    from the flags Linux reports; elsewhere False. Without it PyTorch converts every bfloat16
    matmul through float32, several times slower than float32 itself."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


MATMUL_SHAPES = "128"  # on a CPU, the matmul shapes whose kernels oneDNN and its ideep layer keep (1024 each by default)


def device_and_dtype(device, dtype, hidden_size):
    """The one place that picks the device and the compute dtype: (device string, torch dtype).
    device "auto": CUDA when there is one, else "cpu". A CUDA device always carries its index
    (torch.cuda.set_device refuses a bare "cuda"): "cuda" is cuda:LOCAL_RANK under torchrun,
    cuda:0 otherwise. dtype "auto": bfloat16 on CUDA; on CPU bfloat16 where the CPU computes it
    natively and the model's hidden size is at least BF16_MIN_HIDDEN (a real checkpoint, whose
    matmuls dominate), float32 otherwise (the toy world keeps float32, so its tables stay comparable)."""
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dev == "cpu":  # each matmul shape met (a decoding batch's rows, a micro-batch's tokens) left ~0.5 MB there:
        # a real run grew 0.3-0.6 GB a round. Bounded before the first matmul reads it (a user's setting wins)
        for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
            os.environ.setdefault(var, MATMUL_SHAPES)
    if dev == "cuda":
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if dtype != "auto":
        return dev, getattr(torch, dtype)
    if dev.startswith("cuda"):
        return dev, torch.bfloat16
    return dev, torch.bfloat16 if cpu_has_native_bf16() and hidden_size >= BF16_MIN_HIDDEN else torch.float32


try:
    _LIBC = ctypes.CDLL("libc.so.6")  # glibc (Linux); elsewhere trim_host_memory does nothing
except OSError:
    _LIBC = None


def trim_host_memory():
    """Hand the memory glibc's malloc holds freed back to the OS (malloc_trim); a no-op elsewhere.
    A CPU run frees gigabytes at a time (a checkpoint's serialized copy, a rollout's KV cache) and
    glibc keeps them in its per-thread heaps, where the next phase's allocations (a training step's
    gradients and activations) need not land: on one 24 GB machine a real 0.5B's resident memory
    after a checkpoint save fell from 14.2 GB to 10.3 GB with it."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def setup(device, dtype, hidden_size, masters=True):
    """Ranks, device and compute dtype (`device_and_dtype`). Under torchrun (RANK set): one process
    per device (nccl on CUDA, gloo on CPU). A process group means a sharded policy (`shard`), so
    one process that computes in bfloat16 and trains whole weights (`masters`) joins a one-rank
    group: float32 masters and the same mixed precision as N ranks. One process that trains only
    LoRA adapters needs no masters: `wrap` holds its frozen base in the compute dtype.
    Returns (rank, world_size, device, compute dtype)."""
    dev, dt = device_and_dtype(device, dtype, hidden_size)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.startswith("cuda") else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    elif dt.itemsize < 4 and masters:  # bfloat16 (or float16) compute: mixed precision, as on N ranks
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank, world_size, dev, dt


def check_ranks(questions_per_step, ppo_updates, ofsd_questions, world_size):
    """Every rank needs questions, and the same number of training passes."""
    q = questions_per_step
    if q % world_size or q // world_size < ppo_updates or ofsd_questions < world_size:
        raise SystemExit(f"--questions_per_step={q} must be a multiple of the number of ranks ({world_size}) "
                         f"with at least one question per rank for each of its {ppo_updates} updates, and "
                         f"--ofsd_questions={ofsd_questions} at least the number of ranks: every rank needs "
                         "questions, and the same number of training passes")


def check_compile(compile, device, world_size=1):
    """--compile=true is for one process on CUDA: on a CPU the compiled step measured no faster and a
    run's changing cache shapes make it compile again and again (docs/benchmarks.md)."""
    if compile and (str(device).split(":")[0] != "cuda" or world_size > 1):
        raise SystemExit(f"--compile=true is for one process on a CUDA device (CUDA graphs); this run is on "
                         f"{device} with {world_size} rank(s): on a CPU the compiled decoding step is no faster "
                         "(docs/benchmarks.md), and a sharded model's gathered weights are not what it traced")


def teardown():
    """Leave the process group, the last thing a process does before it exits: a barrier (no rank
    tears its group down while another still talks to it: gloo aborts), then destroy it, then
    hand the GIL to gloo's worker threads for a moment. A worker frees a finished collective's
    tensors after its waiter has returned, and needs the GIL for that; one that asks for it once
    the interpreter has begun to exit is ended mid-free and the process aborts ("terminate called
    without an active exception", exit -6). With FSDP2 sharding and 2 gloo ranks (torch 2.14, a
    2-core AMD EPYC) 8 of 60 runs of a small script aborted so without the pause, 0 of 60 with
    50 ms of it. Destroying the group does not join its threads: torch keeps FSDP's device mesh,
    and with it the group, until the interpreter's last collection (gloo has no wait for them)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.25)


def shard(model, compute_dtype):
    """Shard a float32 Qwen2 over the default process group, per decoder layer and at the root."""
    # gradients reduced in float32 at least (a float64 model, the exactness tests', stays float64)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.promote_types(compute_dtype, torch.float32))
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    register_fsdp_forward_method(model, "hidden")  # training calls hidden(), not forward()
    for m in _units(model):
        m.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is already a global token mean
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    model.compute_dtype = lambda: compute_dtype  # what a KV cache holds: the gathered weights' dtype
    return behind_hidden(model)


def held_dtype(compute_dtype):
    """The dtype a process keeps the weights in: float32 masters when sharded (a process group is up),
    else the compute dtype (load in it: no float32 copy first)."""
    return torch.promote_types(compute_dtype, torch.float32) if dist.is_initialized() else compute_dtype


def wrap(model, compute_dtype):
    """The model as a process holds it: sharded when a process group is up (`shard`), else in the
    compute dtype (float32 stays float32; a LoRA run's frozen base in bfloat16 is half the bytes);
    on a CPU, glibc's heap trimmed before each layer that runs with gradients (`trim_each_layer`)."""
    if dist.is_initialized():
        return trim_each_layer(shard(model, compute_dtype))
    model.to(compute_dtype)
    trim_host_memory()  # the float32 copies just let go
    return behind_hidden(trim_each_layer(model))


def trim_each_layer(model):
    """On a CPU, `trim_host_memory` before each decoder layer that runs with gradients: in the forward,
    and in backward when the gradient reaches the layer's output (before its recomputation). A layer's
    1-32 MB temporaries live in glibc's heap, which fragments: one checkpointed forward of the 0.5B
    (4,344 tokens) grew it by 1.1 GB for 0.2 GB more in use. Decoding (no gradients) is left alone,
    and so is a model narrower than a real one (the toy's temporaries are kilobytes: a trim only costs)."""
    if model.model.embed_tokens.weight.device.type != "cpu" or model.config.hidden_size < BF16_MIN_HIDDEN:
        return model

    def before(block, args):
        if torch.is_grad_enabled():
            trim_host_memory()

    def after(block, args, out):
        if out.requires_grad:
            out.register_hook(lambda grad: trim_host_memory())
    for block in model.model.layers:
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)
    return model


def _units(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model):
    return isinstance(model, FSDPModule)


_LEFT_GATHERED = []  # sharded models whose root a forward without gradients left gathered


def behind_hidden(model):
    """Install, behind model.hidden (the forward every caller uses), what ranks and memory need of a
    method that only calls the model:
    - a decoding forward (one with a KV cache) of a sharded model finds every weight all-gathered once
      and kept (no per-layer gathers for each token; ranks may decode different numbers of steps);
    - the first forward after decoding frees them and hands the freed KV cache back to the OS
      (`trim_host_memory`, before training; one process too), and so does a new decode's first prefill;
    - FSDP2 keeps a root's weights (embeddings, LM head) gathered after a forward without gradients
      (the caller reads lm_head_weight after hidden()); a forward with gradients frees those of every
      other sharded model first (the KL term's model between micro-batches), `reshard` does it too."""
    model._behind = dict(inner=model.hidden if is_sharded(model) else None, decoding=False)  # FSDP's, or the class's
    model.hidden = types.MethodType(_hidden, model)  # a deep copy rebinds it to the copy
    return model


def _hidden(model, input_ids, cache=None, *args, **kwargs):
    """model.hidden as `behind_hidden` installs it. A decoding step (one token a row, already decoding)
    passes straight through: nothing here runs inside a compiled step."""
    state, decoding = model._behind, cache is not None
    sharded = state["inner"] is not None  # FSDP's registered hidden, or the class's
    if decoding != state["decoding"] or (decoding and input_ids.shape[1] > 1):
        _boundary(model, sharded, decoding, input_ids, cache)
    if sharded and not decoding and torch.is_grad_enabled():
        _release_left(model)
    out = (state["inner"] or type(model).hidden.__get__(model))(input_ids, cache, *args, **kwargs)
    if sharded and not decoding and not torch.is_grad_enabled() and model not in _LEFT_GATHERED:
        _LEFT_GATHERED.append(model)
    return out


def _boundary(model, sharded, decoding, input_ids, cache):
    """Entering decoding (a sharded model's weights gathered whole), leaving it (freed, the heap trimmed),
    or a new decode's first prefill (the heap trimmed)."""
    layers = [m for m in _units(model) if m is not model]
    if decoding and not model._behind["decoding"] and sharded:
        _release_left(None)
        for m in layers:
            m.set_reshard_after_forward(False, recurse=False)
        for m in _units(model):
            m.unshard()
    elif not decoding and model._behind["decoding"]:
        if sharded:
            for m in layers:
                m.set_reshard_after_forward(True, recurse=False)
            reshard(model)
        trim_host_memory()  # the KV cache just freed
    if decoding and input_ids.shape[1] > 1 and not bool(cache.end.any()):
        trim_host_memory()  # a prefill into an empty cache: a new decode, the last one's cache freed
    model._behind["decoding"] = decoding


def _release_left(keep):
    """Free the roots that forwards without gradients left gathered, except `keep`'s."""
    for m in [m for m in _LEFT_GATHERED if m is not keep]:
        _LEFT_GATHERED.remove(m)
        reshard(m)


def reshard(model):
    """Free every all-gathered weight, so parameters are the sharded float32 masters again."""
    if model in _LEFT_GATHERED:
        _LEFT_GATHERED.remove(model)
    for m in _units(model):
        m.reshard()


def shard_like(update, weight):
    """This rank's slice of a whole tensor `update` laid out as the sharded parameter `weight`."""
    return distribute_tensor(update, weight.device_mesh, weight.placements, src_data_rank=None)


@torch.no_grad()
def copy_weights(dst, src):
    """dst's weights <- src's (same architecture and layout; each rank copies its own slices)."""
    if is_sharded(src):
        reshard(src)
        reshard(dst)
    for a, b in zip(dst.parameters(), src.parameters(), strict=True):
        a.copy_(b)


def local(t):
    """The part of a tensor this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def park(optimizer, path):
    """Write this rank's optimizer state to `path` and free its memory until `unpark`, and drop its
    parameters' gradients (for a phase that does not step this optimizer: the OFSD round needs
    neither GRPO's AdamW moments nor its last gradients). A plain tensor leaves the state (None in
    its place); a sharded one keeps its shape, not its storage."""
    optimizer.zero_grad(set_to_none=True)
    torch.save([local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)], path)
    for s in optimizer.state.values():
        for k, v in s.items():
            if isinstance(v, DTensor):
                v.to_local().untyped_storage().resize_(0)
            elif torch.is_tensor(v):
                s[k] = None
    trim_host_memory()


@contextlib.contextmanager
def parked(optimizer, path):
    """A phase that does not step `optimizer` (None: nothing to park): its state waits in `path`
    meanwhile (`park`, `unpark`)."""
    if optimizer is not None:
        park(optimizer, path)
    yield
    if optimizer is not None:
        unpark(optimizer, path)


def unpark(optimizer, path):
    """Give the optimizer state back what `park` wrote to `path`, then remove the file."""
    saved = iter(torch.load(path, weights_only=True))
    for s in optimizer.state.values():
        for k, v in s.items():
            if isinstance(v, DTensor):
                t, v = v.to_local(), next(saved)
                t.untyped_storage().resize_(v.untyped_storage().nbytes())
                t.copy_(v)
            elif v is None:
                s[k] = next(saved)
    os.remove(path)


def state_bytes(model, optimizer, reference):
    """Bytes of parameters, gradients, optimizer state and the KL term's model (None: the policy with
    its adapter off, nothing more) held by each rank: a list with one dict per rank (collective)."""
    def size(ts):
        return sum(local(t).numel() * local(t).element_size() for t in ts if t is not None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = dict(params=size(params), grads=size(p.grad for p in params),
                optimizer=size(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
                reference=size(reference.parameters()) if reference is not None else 0)
    return all_ranks([mine])


def rank():
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def replicate(params):
    """Rank 0's values for every rank: parameters attached after sharding (a LoRA adapter) are
    replicated, not sharded. Returns the largest difference it replaced (0.0 in one process): replicas
    that drifted apart (a gradient not summed over the ranks, a non-deterministic kernel) show there."""
    if not dist.is_initialized():
        return 0.0
    drift = []
    for p in params:
        ours = p.data.clone()
        dist.broadcast(p.data, 0)
        drift.append((ours - p.data).abs().max().float())
    drift = torch.stack(drift).max() if drift else torch.zeros(())
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)  # every rank's largest
    return float(drift)


def sum_grads(params):
    """Sum each replicated parameter's gradient over the ranks as backward makes it (a GRPO adapter:
    each rank's trajectories differ; FSDP sums the sharded weights' own)."""
    if dist.is_initialized():
        for p in params:
            p.register_hook(lambda g: all_sum(g.clone()))


def all_sum(t):
    """t summed over every rank, in place (t itself in one process): the collective the method calls
    where a step needs every rank (GRPO's token mean and its logged sums)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_ranks(items):
    """Every rank's list, concatenated in rank order (the list itself in one process; collective)."""
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def full_state_dict(model):
    """{name: full float32 CPU tensor} on rank 0 ({} elsewhere); collective when sharded."""
    if not is_sharded(model):
        return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    reshard(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_world_size() == 1:  # one CPU rank: the "gathered" tensors are the parameters themselves
        state = {n: t.clone() for n, t in state.items()}
    return state


def save_optimizer(model, optimizer, path):
    """AdamW state: one torch.save file (unsharded) or a torch.distributed.checkpoint folder with
    each rank's slices (sharded; collective)."""
    if not is_sharded(model):
        torch.save(optimizer.state_dict(), path + ".pt")
        return
    reshard(model)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def load_optimizer(model, optimizer, path):
    """Restore what save_optimizer wrote, onto the same number of ranks."""
    if not is_sharded(model):
        optimizer.load_state_dict(torch.load(path + ".pt", weights_only=True))
        return
    if not os.path.isdir(path):
        raise SystemExit(f"{path}: no sharded optimizer state (the checkpoint was written by one unsharded "
                         "process); resume it the way it was run")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
