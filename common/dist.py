"""More than one process: torchrun, FSDP2, and the few reductions that make N ranks compute
the update one process computes on the same rollout batch.

    python grpo.py ...                          one process: every function here is the identity
    torchrun --nproc-per-node N grpo.py ...     N ranks, each a full copy of the loop with its own vLLM engine

Each rank samples its own share of the step's prompts (whole groups, so group baselines need no
communication: `share`), generates and scores them with its own engine, and trains on them. The
policy is sharded with FSDP2 (`shard`). What mixes samples across the batch is global: the loss
normalizers (`all_sum`), batch baselines and whitening (`all_sum` of sums and counts), and the
gradient, which FSDP2 sums over ranks (divide factor 1: each rank's loss is already divided by
the global counts, so the ranks' losses add up to the one-process loss). Metrics are averaged
over ranks and logged once, by rank 0, which also evaluates and writes the run folder.

The process group must exist before vLLM is created: an in-process engine otherwise makes
torch.distributed a world of size 1 of its own. On CUDA it is one group with two backends
(`backend`): NCCL for CUDA tensors (FSDP2's gathers and reductions, the loss normalizers) and gloo
for CPU ones (the metrics, the signal flags, the pickled objects of `broadcast` and
`all_gather_objects`); NCCL alone raises on a CPU tensor.

grpo_async.py splits torchrun's processes in two (init with rollout_ranks R, `split`): the last R
sample, the others train, and each side is a torch.distributed world of its own, so everything here
(and vLLM's torchrun launcher on the rollout side) works within a side as within any script's ranks:
the trainer ranks shard, reduce and save among themselves, the rollout ranks share each batch's prompts.
Two more groups join the first trainer rank (0) and the rollout ranks (1..R), outside either world:
LINK (gloo) for the pickled requests and batches, SYNC for the weights (NCCL on CUDA, else LINK).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as tdist

from common.errors import need
from common.ops import masked_mean

# grpo_async.py's split (`split`); LINK and SYNC on the first trainer rank and the rollout ranks only
LINK = None  # gloo group of the first trainer rank (0) and the rollout ranks (1..R): requests, batches
SYNC = None  # the same ranks, for the weights: NCCL on CUDA, LINK on CPU
ROLLOUT_RANKS: list[int] = []  # the rollout ranks' ranks in LINK and SYNC, on every rank of a split
PROCESSES = 1  # torchrun's processes, both sides of the split counted


def backend(device_type: str) -> str:
    """The process group's backend on a compute device: on CUDA, NCCL for CUDA tensors and gloo for
    the CPU tensors some collectives carry (metrics, signal flags, objects); gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def served(name: str) -> set[str]:
    """The device types whose tensors a group created with backend name takes, as torch reads it:
    "nccl" {"cuda"}, "gloo" {"cpu", "cuda"}, "cpu:gloo,cuda:nccl" {"cpu", "cuda"}."""
    from torch.distributed.distributed_c10d import BackendConfig

    return set(BackendConfig(tdist.Backend(name)).get_device_backend_map())


def pick_device(choice: str = "auto") -> str:
    """--device: "auto" is CUDA where torch sees a GPU, else an Apple GPU (MPS) where torch offers one, else
    the CPU; an explicit one must be there (one line if not)."""
    there = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if choice == "auto":
        return "cuda" if there["cuda"] else "mps" if there["mps"] else "cpu"
    need(choice in there, f"--device must be auto, cpu, cuda or mps, got {choice!r}")
    need(there[choice], f"--device {choice}: torch finds no {choice} device here (--device auto picks what it "
                        f"finds: {pick_device()})")
    return choice


def init(device: str = "auto", rollout_ranks: int = 0) -> str:
    """Join torchrun's process group (`backend`); returns the device (`pick_device`). Without torchrun
    (WORLD_SIZE unset or 1) nothing happens. rollout_ranks > 0 (grpo_async.py): the world is this rank's
    side of the split (`split`)."""
    device = pick_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not tdist.is_initialized():
        need(device != "mps", "torchrun on an Apple GPU (mps) is not supported: run one process, or --device cpu")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # the rank's GPU, also for its vLLM engine
        if int(os.environ.get("RANK", "0")) > 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 speaks for the job; errors (stderr) from every rank
        timeout = datetime.timedelta(minutes=30)
        if rollout_ranks:
            split(rollout_ranks, device, timeout)
        else:
            tdist.init_process_group(backend(device), timeout=timeout)
    return device


def split(rollout_ranks: int, device: str, timeout: datetime.timedelta) -> None:
    """The last `rollout_ranks` of torchrun's processes form the rollout side's world, the others the
    trainer side's; LINK and SYNC join the first trainer rank and the rollout ranks. All are made from
    torchrun's store, each under a prefix of its own: vLLM's groups (made over the whole world when an
    engine starts) then span the rollout ranks only, which subgroups of one world could not give (the
    trainer ranks would have to join every one of vLLM's group creations)."""
    global LINK, SYNC, ROLLOUT_RANKS, PROCESSES
    W, global_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    need(0 < rollout_ranks < W, f"--rollout-ranks must leave a trainer rank: 1 to {W - 1} of torchrun's {W} "
                                f"processes, got {rollout_ranks}")
    store, _, _ = next(tdist.rendezvous("env://", timeout=timeout))
    trainers = W - rollout_ranks
    samples = global_rank >= trainers
    side_rank, side_size = (global_rank - trainers, rollout_ranks) if samples else (global_rank, trainers)
    hook = sys.excepthook
    tdist.init_process_group(backend(device), store=tdist.PrefixStore("rollout" if samples else "train", store),
                             rank=side_rank, world_size=side_size, timeout=timeout)
    # torch's hook would head a traceback "[rank0]" on both sides: say which process it is
    side = f"{'rollout' if samples else 'trainer'} rank {side_rank} (torchrun rank {global_rank})"
    sys.excepthook = lambda *error: (print(f"{side}:", file=sys.stderr), hook(*error))
    if samples:  # vLLM's torchrun launcher (external_launcher) reads its rank and world from the environment
        os.environ.update(RANK=str(side_rank), WORLD_SIZE=str(side_size))
    if global_rank == 0 or samples:
        link_rank = side_rank + 1 if samples else 0
        LINK = tdist.ProcessGroupGloo(tdist.PrefixStore("link", store), link_rank, rollout_ranks + 1, timeout)
        SYNC = LINK if device != "cuda" else tdist.ProcessGroupNCCL(tdist.PrefixStore("sync", store), link_rank,
                                                                     rollout_ranks + 1)
    ROLLOUT_RANKS, PROCESSES = list(range(1, rollout_ranks + 1)), W


def is_rollout_rank() -> bool:
    """grpo_async.py under torchrun: this process samples (it is on the rollout side of the split)."""
    return LINK is not None and LINK.rank() > 0


def processes() -> int:
    """torchrun's processes, both sides of a split counted."""
    return PROCESSES if ROLLOUT_RANKS else world_size()


def world_size() -> int:
    # a one-process run's vLLM engine initializes torch.distributed as a world of size 1
    return tdist.get_world_size() if tdist.is_initialized() else 1


def rank() -> int:
    # before init (parsing the arguments) torchrun's RANK says it
    return tdist.get_rank() if tdist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def share(items: list) -> list:
    """This rank's contiguous share of items (len(items) divisible by the world size); in rank
    order the shares are items again, so N ranks see exactly one process's batch."""
    n = len(items) // world_size()
    return items[rank() * n:(rank() + 1) * n]



def share_whole(items: list) -> tuple[list, int]:
    """Items that every rank holds alike (pooled with all_gather_objects), shared evenly: the
    largest multiple of N of them, each rank its equal share. Returns (this rank's share, how
    many were shared in all)."""
    n = len(items) - len(items) % world_size()
    return share(items[:n]), n

def all_sum(x) -> torch.Tensor:
    """x (a tensor or a number) summed over ranks, as a new float64 tensor on x's device: counts and sums
    that normalize a loss or a baseline are the global ones."""
    x = torch.as_tensor(x).detach().to(torch.float64).clone()
    if world_size() > 1:
        tdist.all_reduce(x)
    return x


def all_max(x: torch.Tensor) -> torch.Tensor:
    """x's elementwise max over ranks, as a new tensor."""
    x = x.detach().clone()
    if world_size() > 1:
        tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
    return x


def first_index(count: int) -> int:
    """Where this rank's `count` items start in the whole batch (rank order): the lower ranks' counts
    summed. Equal shares give rank * count; multi-turn episodes still going after a turn do not."""
    if world_size() == 1:
        return 0
    return int(all_gather(torch.tensor([count]))[:rank()].sum())


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x concatenated in rank order (dim 0): the whole batch's values (e.g. rewards)."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    tdist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def minibatch_totals(loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tokens, sequences) of a minibatch summed over ranks: the normalizers under which the
    ranks' micro-batch losses add up to the loss of one process over the whole minibatch."""
    totals = all_sum(torch.stack([loss_mask.sum().double(), torch.tensor(loss_mask.shape[0], dtype=torch.float64,
                                                                          device=loss_mask.device)]))
    return totals[0], int(totals[1])


def global_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of values over every rank's rows (a batch-mean baseline), in values' dtype."""
    if world_size() == 1:
        return values.mean()  # one process: exactly the local mean, as before torchrun support
    totals = all_sum(torch.stack([values.sum().double(), torch.tensor(values.numel(), dtype=torch.float64,
                                                                       device=values.device)]))
    return (totals[0] / totals[1]).to(values.dtype)


def global_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of values over mask on every rank (whitening over the whole batch), in values' dtype."""
    if world_size() == 1:
        return masked_mean(values, mask)
    mask = mask.to(values.dtype)
    totals = all_sum(torch.stack([(values * mask).sum().double(), mask.sum().double()]))
    return (totals[0] / totals[1].clamp(min=1)).to(values.dtype)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(v - mean) / std over the masked entries (the batch's completion tokens, on all ranks); 0 elsewhere
    (PPO's advantages, REINFORCE++'s returns)."""
    mean = global_masked_mean(values, mask)
    var = global_masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def all_gather_objects(items: list) -> list:
    """The ranks' lists of picklable objects concatenated in rank order (DAPO's kept groups)."""
    if world_size() == 1:
        return items
    lists = [None] * world_size()
    tdist.all_gather_object(lists, items)
    return [item for part in lists for item in part]


def is_count(key: str) -> bool:
    """A metric that counts events (reward calls past their limit, environment calls and their
    timeouts): summed over ranks and over an evaluation's parts, never averaged."""
    return key.endswith(("timeouts", "/calls"))


def mean_over_ranks(metrics: dict) -> dict:
    """Each metric averaged over ranks (equal shares: a mean over the batch is exact; std and
    token-weighted means are the ranks' average), except counts of events on a rank (is_count), which
    are summed: the whole batch's, and extremes ("..._min", "..._max"), the whole batch's min and max. One reduction for all, and one more for the extremes."""
    if world_size() == 1:
        return metrics
    keys = sorted(metrics)
    values = all_sum(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)).tolist()
    reduced = {k: v if is_count(k) else v / world_size() for k, v in zip(keys, values)}
    extremes = [k for k in keys if k.endswith(("_min", "_max"))]
    if extremes:  # min x = -max(-x): one MAX reduction
        signs = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in extremes], dtype=torch.float64)
        signed = all_max(signs * torch.tensor([float(metrics[k]) for k in extremes], dtype=torch.float64))
        reduced.update(zip(extremes, (signs * signed).tolist()))
    return reduced


def broadcast(obj):
    """Rank 0's obj on every rank (any picklable object)."""
    if world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn, *args):
    """fn(*args) on rank 0 only, its result on every rank; an error it raises is raised on every
    rank (not a hang of the others at their next collective)."""
    result, error = None, None
    if is_main():
        try:
            result = fn(*args)
        except Exception as e:
            error = e
    result, error = broadcast((result, error))
    if error is not None:
        raise error
    return result


def barrier() -> None:
    if world_size() > 1:
        tdist.barrier()


def shard(model: torch.nn.Module, precision, called_alone: tuple = ()) -> torch.nn.Module:
    """FSDP2 (fully_shard) over the ranks: each decoder layer is one unit, the rest (embeddings,
    final norm, heads) the root's; the model is returned, sharded in place. Forward passes gather a
    layer's weights just before it runs and free them after. Gradients are summed over ranks, not
    averaged (see the module docstring). called_alone: submodules the caller runs directly rather
    than through the model's forward (PPO's critic: its body and its value head), each a unit of
    its own so that calling it gathers its weights. Every rank starts from rank 0's weights, as one
    process would (what FSDP1's sync_module_states did): weights drawn at load (LoRA's adapters, PPO's
    value head) come from each rank's own generator (common/run.py seed_everything). One process: the
    model as it is.

    precision (common/setup.py's Precision) under bf16: FSDP2's own mixed precision. Each unit's
    weights are gathered in bf16 (half the traffic) and the forward and backward run on those, the
    gradients are reduce-scattered in fp32, and the shards (the optimizer's weights) keep their
    dtype. Autocast alone would gather fp32 weights and keep its bf16 copy of each for the
    backward: a whole bf16 model per rank. The scripts' autocast stays on around the forward (it
    keeps the softmax-like ops in fp32, and is the one-process path); over bf16 weights it copies
    nothing."""
    if world_size() == 1 or not any(True for _ in model.parameters()):  # e.g. LoRA's reference: adapters off
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    for p in model.parameters():  # rank 0's weights everywhere (see above)
        tdist.broadcast(p.detach(), src=0)
    bf16 = precision.autocast_dtype
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=policy)
    for module in called_alone:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum over ranks, not a mean
            module.set_force_sum_reduction_for_comms(True)  # as a plain SUM: gloo has no pre-scaled sum
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) weight or gradient gathered whole on every rank; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state_dict(model: torch.nn.Module) -> dict | None:
    """A sharded model's whole weights, gathered to rank 0's CPU (every rank takes part; the
    others get {}), for save_pretrained(state_dict=...). One process: None (the model's own)."""
    if world_size() == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state_dict(models: dict, optimizer) -> dict:
    """The optimizer's state keyed by parameter names (models: {"policy": policy, ...}, the
    modules whose parameters it updates), each rank holding its shards: what
    torch.distributed.checkpoint saves, and loads into another world size by resharding."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(torch.nn.ModuleDict(models), optimizer)


def load_optimizer_state_dict(models: dict, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(torch.nn.ModuleDict(models), optimizer, state)
