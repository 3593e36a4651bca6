"""What one save's metadata costs at 8 to 16,384 ranks, simulated on one process (issue 57).

    python bench/bench_scale_sim.py [--model 8b,70b,405b] [--engines zero12,zero3,fsdp2,ddp] [--ranks 8,512,16384]
                                    [--variants plain,o1,residual] [--json]

No process is launched: a simulated `dist` (`SimDist`, installed in place of `hf_unified_ckpt.dist`'s collectives)
plays one rank of a world of N, and the library's own save-planning code runs on it — `plan_save` (the shard plan,
the census of pieces or the rule's bounds, the residual census, owners), the file plans the writers walk
(`SavePlan.files`, `items_of`, `pieces_held`), the records and their combination (`conclude`'s functions,
`crc32_combine`), the direct writer's run cutting (`store.direct._Runs`) and the multipart part plans
(`format.parts.plan_parts`) — with a synthetic engine (`SimEngine`) whose specs are Llama-3's public configs and
whose per-rank fragments follow each engine's partition rule:

- ZeRO-3: every parameter split in ceil(numel / N) elements per rank;
- ZeRO-1/2: each param group's flat buffer (the Trainer's two groups: decayed weights, then norms) padded to a
  multiple of 2N and split in N equal partitions; a parameter's fragment is its overlap with a rank's partition;
- FSDP2: Shard(0), ceil(dim0 / N) rows per rank;
- DDP: every rank holds everything.

Every collective counts its real payload: an object collective the pickled bytes (torch pickles each rank's object;
`all_gather_object` first gathers the sizes, 8 bytes per rank, then every payload padded to the largest, so each
rank receives N x (8 + max)); a tensor collective its tensor's bytes; a point-to-point message its bytes. The other
ranks' payloads are made by running the same library function for that rank (`SimDist.peers`: the caller's
function is called again for rank q with its arguments, and the collective it reaches hands back q's payload).

What it reports per row (`--json`: one JSON line per row):
- `plan_s`, `plan_cached_s`: CPU seconds of one rank's planning on the training thread (plan_save and the walk of
  the file plans the save does: the writer's prepare, which files it writes, its items and pieces), first save and
  a second save with the same engine; the time the simulation spends making other ranks' payloads is excluded
  (unpickling what a rank receives is included). Rank 0 and the last rank are run; the larger is reported. Each
  timed plan starts after a `gc.collect()`, with the objects of the imported modules frozen (`gc.freeze`): the
  garbage collections a plan triggers walk what the process allocated since, not torch's ~170,000 objects (a full
  collection of those costs 0.1-0.3 s here, whenever the allocations of anything trigger one).
- `ties_data_s` (rows with residual master weights): the residual census's pass over the rank's real master
  elements, estimated (`ties_data_s()`); `plan_cached_s` has the census' work per fragment, the simulated
  fragments holding 8 elements each. The ties the census sums change from save to save, as in training.
- `plan_peak_mib`: tracemalloc's peak during the first save's planning on rank N-1 (a separate run).
- `received_per_rank_bytes`: all the save's collectives, one save, the largest over the ranks simulated other
  than rank 0; `rank0_received_bytes`, `rank0_s` (rank 0's extra work after the writes: records combined, manifest
  built).
- `files`, `writers_per_file_max`; `write_bytes_ge_8mib_fraction` (the smallest, over the ranks simulated, share of a
  rank's bytes written in calls of at least 8 MiB by the direct writer) and `unaligned_calls` (the most calls not
  4 KiB-aligned, offset or length, of one rank); `s3_received_over_uploaded` (a bucket save: per rank, bytes handed
  to it by other ranks over the bytes it uploads; the largest), from the part plans of at most `--s3-files` files
  spread over the checkpoint (sampled, said in the row).
- `sampled_ranks`: the ranks whose work was run (the others only make payloads).

Where a row's simulation would hold too much (the census of today's code is N x T tuples on every rank), rows
above `--max-entries` peer entries are skipped and said; the growth exponents (log ratio of a figure from the
smallest to the largest of the rows at 512 and 16,384 ranks) are printed at the end, with the file count's and the
first plan's per file (the file count grows with N: `target_shard_size` gives every writer a file, down to files of
64 MiB that never split a tensor, so it is bounded by T and reached at a few thousand ranks).

This differs from `bench_scaling.py`, which launches real ranks (2-4 here) and times real saves: this one runs no
I/O and no real collective; it measures the save's metadata work and traffic where launches cannot go.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import pickle
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hf_unified_ckpt import dist as real_dist  # noqa: E402
from hf_unified_ckpt.checkpoint.save import rule_plan, saving as save_mod  # noqa: E402
from hf_unified_ckpt.engines.base import Fragment  # noqa: E402
from hf_unified_ckpt.format.components import MASTER, MODEL, OPTIMIZER, saved_by  # noqa: E402
from hf_unified_ckpt.format.names import optimizer_key, split_optimizer_key  # noqa: E402
from hf_unified_ckpt.format.planning import Mapped, OwnOnly, Strided, TensorSpec  # noqa: E402
from hf_unified_ckpt.options import UnifiedCheckpointOptions  # noqa: E402

MiB = 2**20
MODELS = {  # Llama-3 / 3.1 public configs
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    "405b": dict(hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, vocab=128256),
}
ENGINES = ("zero12", "zero3", "fsdp2", "ddp", "mics")
STATES = ("exp_avg", "exp_avg_sq")
#: Ranks per machine (8 GPUs), and the filesystem's block every rank agrees on (`aggregating.agreed_layout`).
LOCAL_WORLD = 8
_MASTER = (torch.linspace(-1, 1, 8), torch.linspace(-1, 1, 8).to(torch.bfloat16))


def llama_params(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Llama model, in `named_parameters` order."""
    h, i, v = cfg["hidden"], cfg["intermediate"], cfg["vocab"]
    kv = cfg["kv_heads"] * (h // cfg["heads"])
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


class Lazy:
    """The values of a fragment without its data: `numel`, and real (zero) elements for the few a codec reads."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> torch.Tensor:
        return torch.zeros(len(range(*index.indices(self.n))), dtype=torch.float32)


@dataclasses.dataclass
class SimModel:
    """A model's parameters under one engine at world size N: the partition rule of every parameter."""

    engine: str
    world: int
    params: list[tuple[str, tuple[int, ...]]]
    master: bool  # fp32 master weights next to bf16 weights (DeepSpeed bf16)

    def __post_init__(self):
        self.shape = dict(self.params)
        self.numel = {n: math.prod(s) for n, s in self.params}
        self.rule: dict[str, Strided] = {}
        N = self.world
        if self.engine == "zero12":  # the Trainer's groups: weights with decay, then the norms without
            groups = [[n for n, s in self.params if len(s) > 1], [n for n, s in self.params if len(s) == 1]]
            for names in groups:
                total, at = sum(self.numel[n] for n in names), 0
                padded = -(-total // (2 * N)) * 2 * N
                for n in names:
                    self.rule[n] = Strided(self.numel[n], padded // N, at)
                    at += self.numel[n]
        elif self.engine in ("zero3", "mics"):
            self.rule = {n: Strided(c, -(-c // N)) for n, c in self.numel.items()}
        elif self.engine == "fsdp2":
            self.rule = {n: Strided(c, -(-self.shape[n][0] // N) * (c // self.shape[n][0]))
                         for n, c in self.numel.items()}

    def piece(self, name: str, rank: int) -> tuple[int, int] | None:
        """(first element, count) rank `rank` holds of parameter `name` (None: it holds it whole)."""
        return self.rule[name].of(rank) if name in self.rule else None


class SimEngine:
    """An `EngineAdapter` for planning only: specs, owners, fragments (`Lazy` values) of one rank of a `SimModel`.
    Its methods mirror the real adapters' (engines/deepspeed.py, fsdp.py, replicated.py) where they communicate."""

    def __init__(self, model: SimModel, rank: int):
        self.model, self.rank = model, rank
        self.engine = {"zero12": "deepspeed-zero2", "zero3": "deepspeed-zero3", "fsdp2": "fsdp",
                       "ddp": "ddp", "mics": "deepspeed-zero3"}[model.engine]
        self._frag_sizes = None
        self._confirmed = False
        self.exchanged = 0

    def partition_rule(self, component: str, names=None):
        """As the real adapters' (`DeepSpeedEngine.partition_rule`...): the rule's pieces of every sharded tensor;
        "mics" stands for an engine whose layout does not follow the world size alone (MiCS, HSDP, TP, EP)."""
        if self.model.engine == "mics":
            return None, "MiCS (shard groups smaller than the world)"
        out = {}
        for name in [s.name for s in self.specs(component)] if names is None else names:
            if self._sharded(component, name):
                param = split_optimizer_key(name)[0] if component == OPTIMIZER.name else name
                out[name] = self.model.rule[param]
        return out, self.engine

    def confirm_rule(self) -> None:
        self._confirmed = True

    # description
    def saved_by(self) -> dict:
        m = self.model
        kind = "deepspeed" if m.engine.startswith("zero") else m.engine
        return saved_by(kind, m.world, [torch.bfloat16 if m.master else torch.float32],
                        zero_stage={"zero12": 2, "zero3": 3}.get(m.engine), master_weights=m.master)

    def components(self):
        return [MODEL, *([MASTER] if self.model.master else []), OPTIMIZER]

    def specs(self, component: str) -> list[TensorSpec]:
        m = self.model
        if component == MODEL.name:
            dtype = torch.bfloat16 if m.master else torch.float32
            return [TensorSpec(n, s, dtype) for n, s in m.params]
        if component == MASTER.name:
            return [TensorSpec(n, s, torch.float32) for n, s in m.params]
        return [TensorSpec(optimizer_key(n, k), s, torch.float32) for n, s in m.params for k in STATES] + \
            [TensorSpec(optimizer_key(n, "step"), (), torch.float32) for n, _ in m.params]

    def optimizer_metadata(self) -> dict:
        names = [n for n, _ in self.model.params]
        return {"param_groups": [{"lr": 1e-4, "weight_decay": 0.0, "params": names}], "scalars": {}}

    # where the pieces are
    def _sharded(self, component: str, name: str) -> bool:
        m = self.model
        if m.engine == "ddp" or name.endswith("/step"):
            return False
        return not (m.engine == "zero12" and component == MODEL.name)

    def fragments(self, component: str, names=None) -> dict[str, Fragment]:
        names = [s.name for s in self.specs(component)] if names is None else names
        out = {}
        for name in names:
            if not self._sharded(component, name):
                continue
            param = split_optimizer_key(name)[0] if component == OPTIMIZER.name else name
            first, count = self.model.piece(param, self.rank)
            out[name] = Fragment(self.model.shape[param], first, Lazy(count))
        return out

    def _fragment_sizes(self) -> dict[str, list[int]]:
        """ZeRO-1/2: as `DeepSpeedEngine._fragment_sizes` (one all-gather of every rank's fragment sizes)."""
        if self._frag_sizes is None:
            local = {n: c for n, _ in self.model.params if (c := self.model.piece(n, self.rank)[1])}
            everyone = real_dist.all_gather_object(local)
            self._frag_sizes = {n: [r.get(n, 0) for r in everyone] for n, _ in self.model.params}
        return self._frag_sizes

    def preferred_owners(self, component: str) -> dict[str, int]:
        """As `DeepSpeedEngine.preferred_owners`: ZeRO-1/2's fp32 tensors go to the rank holding most of them."""
        if self.model.engine != "zero12":
            return {}
        if self._confirmed:
            owner = {n: self.model.rule[n].majority() for n, _ in self.model.params}
        else:
            sizes = self._fragment_sizes()
            owner = {n: max(range(len(s)), key=lambda r: (s[r], -r)) for n, s in sizes.items()}
        if component == MODEL.name:
            return {}
        return {s.name: owner[split_optimizer_key(s.name)[0] if component == OPTIMIZER.name else s.name]
                for s in self.specs(component)}

    def master_fragments(self):
        """(name, fp32 elements, bf16 elements) of this rank's master fragments: a few real elements each (the
        census counts ties; their number does not change the payload's shape). Straight from the parameters, as
        `DeepSpeedEngine.master_fragments` walks them (no specs)."""
        for name, _ in self.model.params:
            if self._sharded(MASTER.name, name):
                n = min(self.model.piece(name, self.rank)[1], 8)
                if n:  # views of shared elements, as the real adapters' are views of the engine's flat partitions
                    yield name, _MASTER[0][:n], _MASTER[1][:n]

    def exchange(self, component: str, names, owner: int) -> None:
        self.exchanged += sum(1 for n in names if self._sharded(component, n))

    def tensors(self, component, names):
        raise NotImplementedError("the simulation writes no tensor")


class Captured(Exception):
    """Raised by a collective on a peer rank: its payload is what the simulation came for."""

    def __init__(self, payload):
        self.payload = payload


class SimDist:
    """One rank (`me`) of a world of `world`, in place of `hf_unified_ckpt.dist`'s collectives. Counts every
    collective and message this rank receives (`log`: (kind, caller, bytes received)). An object collective's
    other payloads come from running the caller again as rank q (`peers`: where that collective raises `Captured`,
    or what the peer function returns); a tensor all-reduce's result from `reducers` (default: every rank
    contributes what this one does: statuses, digests); a message from rank q from `messages`."""

    def __init__(self, world: int, me: int, engines, peers: dict, reducers: dict, messages: dict):
        self.world, self.me, self.engines = world, me, engines
        self.peers, self.reducers, self.messages = peers, reducers, messages
        self.log: list[tuple[str, str, int]] = []
        self.capture = False
        self.excluded = 0.0  # seconds spent making other ranks' payloads

    # identity
    def rank(self) -> int:
        return self.me

    def world_size(self) -> int:
        return self.world

    def is_distributed(self) -> bool:
        return True

    def barrier(self) -> None:
        self.log.append(("barrier", "", 0))

    @staticmethod
    def _caller() -> tuple[str, dict]:
        frame = sys._getframe(2)
        return frame.f_code.co_name, frame.f_locals

    def _peer(self, caller: str, local: dict, q: int):
        """Rank q's payload at this collective."""
        make = self.peers.get(caller)
        if make is None:
            raise KeyError(f"the simulation has no peer payload for a collective in {caller}()")
        t0 = time.process_time()
        saved, self.me, self.capture = self.me, q, True
        try:
            return make(self.engines(q), local)
        except Captured as c:
            return c.payload
        finally:
            self.me, self.capture = saved, False
            self.excluded += time.process_time() - t0

    def all_gather_object(self, obj, group=None) -> list:
        if self.capture:
            raise Captured(obj)
        caller, local = self._caller()
        out, sizes = [None] * self.world, []
        for q in range(self.world):
            payload = obj if q == self.me else self._peer(caller, local, q)
            t0 = time.process_time()
            out[q] = pickle.dumps(payload)
            self.excluded += time.process_time() - t0
            sizes.append(len(out[q]))
        out = [pickle.loads(d) for d in out]  # the receiver's own work
        self.log.append(("all_gather_object", caller, self.world * (8 + max(sizes))))
        return out

    def broadcast_object(self, obj, src: int = 0, group=None):
        if self.capture:
            raise Captured(obj)
        caller, local = self._caller()
        if self.me == src:
            self.log.append(("broadcast_object", caller, 0))
            return obj
        obj = self._peer(caller, local, src)
        t0 = time.process_time()
        data = pickle.dumps(obj)
        self.excluded += time.process_time() - t0
        self.log.append(("broadcast_object", caller, 8 + len(data)))
        return pickle.loads(data)

    def all_reduce_ints(self, values: list[int], op: str = "sum", group=None) -> list[int]:
        """Counted as 2 x the vector's bytes received (a ring all-reduce's reduce-scatter and all-gather)."""
        if self.capture:
            raise Captured(values)
        caller, local = self._caller()
        reducer = self.reducers.get(caller)
        out = reducer(values, op, local) if reducer is not None else list(values)
        self.log.append(("all_reduce", caller, 2 * 8 * len(values)))
        return out

    def exclusive_scan_ints(self, values: list[int], group=None) -> list[int]:
        """The simulated ranks hold no ties (the census' counts are zero): zeros; log2(N) messages received."""
        rounds = max(0, math.ceil(math.log2(self.world))) if self.me else 0
        self.log.append(("scan", self._caller()[0], rounds * 8 * len(values)))
        return [0] * len(values)

    def exchange_tensors(self, sends: dict, receives: dict, group=None) -> dict:
        if not sends and not receives:
            return {}
        caller, _ = self._caller()
        size = sum(numel * dtype.itemsize for numel, dtype in receives.values())
        self.log.append(("p2p", caller, size))
        return {src: torch.zeros(numel, dtype=dtype) for src, (numel, dtype) in receives.items()}

    def send_bytes(self, data: bytes, dst: int, group=None) -> None:
        if self.capture:
            raise Captured(data)

    def recv_bytes(self, src: int, group=None) -> bytes:
        caller, local = self._caller()
        t0 = time.process_time()
        data = self.messages[caller](src, local)
        self.excluded += time.process_time() - t0
        self.log.append(("p2p", caller, 8 + len(data)))
        return data

    def cpu_group(self):
        return None

    def gloo_group(self, purpose: str, timeout=None):
        return None

    def default_timeout(self):
        return None

    def install(self):
        """Put this simulation in place of `hf_unified_ckpt.dist`'s functions; returns what to put back."""
        names = [n for n in ("rank", "world_size", "is_distributed", "barrier", "all_gather_object",
                             "broadcast_object", "cpu_group", "gloo_group", "default_timeout", "all_reduce_ints",
                             "exclusive_scan_ints", "exchange_tensors", "send_bytes", "recv_bytes")
                 if hasattr(real_dist, n)]
        saved = {n: getattr(real_dist, n) for n in names}
        for n in names:
            setattr(real_dist, n, getattr(self, n))
        return saved


def restore(saved: dict) -> None:
    for n, f in saved.items():
        setattr(real_dist, n, f)


def peer_functions() -> dict:
    """Per function of the library that runs an object collective: how rank q reaches it (rank q's engine, the
    caller's local variables). A payload depends only on rank q's own state, so calling the function again as
    rank q up to its collective gives it."""
    return {
        "census_of_pieces": lambda engine, local: save_mod.census_of_pieces(engine, local["plans"]),
        "residual_census": lambda engine, local: save_mod.residual_census(engine),
        "_fragment_sizes": lambda engine, local: engine._fragment_sizes(),
        "open_staging": lambda engine, local: save_mod.open_staging(local["final"]),
        "conclude": lambda engine, local: (True, {}),  # rank 0's status: a shared folder sends no small files
    }


def reducers(model: SimModel) -> dict:
    """All-reduces whose result is not what this rank contributes: the residual census' sums (no rank fails the
    bf16 check; a tensor is held where the rule gives it elements; its ties, about one value in 2^17 as in trained
    weights, change from save to save as they do in training (every tensor's, at every save: no later save has the
    census the plan was cached with, so each plans the master weights' files again, as training does: a cached
    save timed at a census seen before would time a case training does not have). The simulated rank's own
    elements hold none)."""
    saves = [0]

    def residual(values, op, local):
        names = local["names"]
        saves[0] += 1
        held = [int(bool(model.numel[n]) and (model.engine == "ddp" or n in model.rule)) for n in names]
        ties = [(model.numel[n] >> 17) + saves[0] + i % 3 if h else 0 for i, (n, h) in enumerate(zip(names, held))]
        return [0] * len(names) + held + ties
    return {"residual_census": residual,
            "agreed_layout": lambda values, op, local: [LOCAL_WORLD, -LOCAL_WORLD, 4096]}


def subtree_rows(files: list, lo: int, hi: int, rng: random.Random, plans: dict | None = None) -> list:
    """The rows ranks [lo, hi) send up `record_tree`'s tree: their ranges of every file, joined where they meet
    (CRCs made up). From the closed-form pieces: a subtree's piece of a tensor is one range (of an O1/O2 codec's codes
    and scales: those of the blocks that start among the subtree's elements); of a file aggregated (`plans`: the
    aggregating writer's), the cells of its aggregators among them."""
    from hf_unified_ckpt.checkpoint.save.record_tree import merged
    from hf_unified_ckpt.format.planning import piece_of

    rows = []
    for index, file in enumerate(files):
        if plans and file.name in plans:
            rows += [(index, a, b, rng.getrandbits(32)) for a, b, owner in plans[file.name].cells if lo <= owner < hi]
            continue
        head = len(file.header_bytes)
        if lo <= file.header_rank < hi:
            rows.append((index, 0, head, rng.getrandbits(32)))
        for _, start, end, itemsize, pieces in file.layout:
            if pieces is None:
                if lo <= file.header_rank < hi:
                    rows.append((index, head + start, head + end, rng.getrandbits(32)))
                continue
            if isinstance(pieces, OwnOnly):  # the residual's ties: each rank knows its own; modelled spread evenly
                pieces = spread(pieces.holders(), (end - start) // itemsize)
            if not hasattr(pieces, "holders"):  # listed pieces (the census)
                rows += [(index, head + start + f * itemsize, head + start + (f + c) * itemsize, rng.getrandbits(32))
                         for r, f, c in pieces if lo <= r < hi and c]
                continue
            ranks = range(max(lo, pieces.holders().start), min(hi, pieces.holders().stop))
            if not len(ranks):
                continue
            base = pieces.base if isinstance(pieces, Mapped) else pieces  # a codec's: blocks starting in the range
            first = piece_of(base, ranks[0])[0]
            last = piece_of(base, ranks[-1])
            first, count = (pieces.fn if isinstance(pieces, Mapped) else lambda f, c: (f, c))(
                first, last[0] + last[1] - first)
            a, b = head + start + first * itemsize, head + start + (first + count) * itemsize
            if b > a:
                rows.append((index, a, b, rng.getrandbits(32)))
    return merged(sorted(rows))


def spread(holders: range, numel: int) -> Strided:
    """`numel` elements split as evenly as a `Strided` splits them over the ranks `holders`."""
    size = max(1, -(-numel // max(1, len(holders))))
    return Strided(numel, size, holders.start * size) if len(holders) else Strided(0, 1)


def small_records(rank: int) -> list:
    """A rank's small files' records (its RNG state; rank 0's trainer state too)."""
    from hf_unified_ckpt.checkpoint.folder.files import FileRecord

    out = [FileRecord(f"rng_state_{rank}.pth", 14583, f"{random.Random(rank).getrandbits(32):08x}")]
    return out + ([FileRecord("trainer_state.json", 2345, "0badc0de")] if rank == 0 else [])


def messages(files_of, world: int, me: int, plans_of=dict) -> dict:
    """What rank `src` sends to the simulated rank in `record_tree.reduce_records`, made from the plan's closed
    forms (CRCs made up): a folded rank's rows (`reduce_records`, ranks P and up), a partner's rows of the files this
    rank keeps at one step of the halving (`_swap`: the partner's block of ranks), a rank's final message to rank 0
    (its files' rows over every rank, its small files' records: the caller's loop variable `q`)."""
    from hf_unified_ckpt.checkpoint.save.record_tree import halving_steps, pack

    p2 = 1 << (world.bit_length() - 1)
    cache: dict = {}

    def block_rows(lo: int, hi: int, files: tuple[int, int]) -> list:
        rows = subtree_rows(files_of(), lo, hi, random.Random(lo), plans_of()) + \
            [r for q in range(max(lo, 0) + p2, min(hi + p2, world)) for r in subtree_rows(files_of(), q, q + 1,
                                                                                         random.Random(q), plans_of())]
        return sorted(r for r in rows if files[0] <= r[0] < files[1])

    def final(src: int) -> bytes:
        if "all" not in cache:
            cache["all"] = subtree_rows(files_of(), 0, world, random.Random(0), plans_of())
        lo, hi = halving_steps(src, world, len(files_of()))[1]
        rows = [r for r in cache["all"] if lo <= r[0] < hi]
        return pickle.dumps((pack(rows), small_records(src)))

    def reduce_records(src, local):
        if "q" in local:
            return final(src)
        return pack(subtree_rows(files_of(), src, src + 1, random.Random(src), plans_of()))

    def swap(src, local):
        d = src ^ me
        step = next(s for s in halving_steps(me, world, len(files_of()))[0] if s[0] == src)
        first = src - src % d
        return pack(block_rows(first, first + d, (step[1], step[2])))

    return {"reduce_records": reduce_records, "_swap": swap}


@dataclasses.dataclass
class Row:
    model: str
    engine: str
    variant: str
    ranks: int


def request_of(variant: str, root: str) -> save_mod.SaveRequest:
    options = UnifiedCheckpointOptions(enabled=True, quant_stage="O1" if variant == "o1" else "O0",
                                       residual_master_weight=variant == "residual")
    return save_mod.SaveRequest(root, 1, options, show_progress=False)


class World:
    """The engines of every rank of one row (made on demand: only the ranks whose payloads are needed)."""

    def __init__(self, model: SimModel):
        self.model = model
        self._engines: dict[int, SimEngine] = {}

    def __call__(self, rank: int) -> SimEngine:
        engine = self._engines.get(rank)
        if engine is None:
            engine = SimEngine(self.model, rank)
            if len(self._engines) < 64:
                self._engines[rank] = engine
        return engine


@dataclasses.dataclass
class Walk:
    """One rank's walk of a save's files (`plan_once`): the files it writes and the write strategy; `ranges()` what
    it writes of each, made once after the planning is timed (the write thread's work)."""

    rank: int
    files: list
    writer: object
    _ranges: list | None = None

    def ranges(self) -> list:
        """(file, its (offset, length) ranges this rank writes), file by file."""
        if self._ranges is None:
            self._ranges = [(file, written_ranges(self.writer, file, self.rank)) for file in self.files]
        return self._ranges


def forget_plans() -> None:
    """Forget the plans kept from save to save (the shard plan's, the aggregation's): the next is a first save."""
    rule_plan._CACHE.clear()
    try:
        from hf_unified_ckpt.checkpoint.write import aggregating
    except ImportError:
        return
    aggregating._PLANS.clear()


def plan_once(sim: SimDist, engine: SimEngine, request) -> tuple[object, Walk]:
    """One rank's planning on the training thread, as `saving.begin` does it (the staging folder aside): the plan,
    the writer's `set_up` (which files are aggregated, their ranges), and the walk of the files (what it assembles,
    which it writes, the pieces it holds)."""
    with getattr(save_mod, "paused_gc", contextlib.nullcontext)():  # as `saving.begin` plans (since issue 57)
        try:
            plan = save_mod.plan_save(engine, request, shared=True, rank_local=True)
        except TypeError:  # the code before issue 57
            plan = save_mod.plan_save(engine, request, shared=True)
        writer = writer_of(sim.me, request)
        files = plan.files
        writer.set_up("sim", files)
        mine = []
        for file in files:
            writer.assemble(engine, file)
            if writer.writes(file, sim.me):  # the files `saving.begin` keeps; the pieces asked as its write asks
                file.pieces_held(sim.me)
                mine.append(file)
        planned_at_write(writer, files, sim.me)
    return plan, Walk(sim.me, mine, writer)


def planned_at_write(writer, files: list, rank: int) -> None:
    """The aggregation plans `rank` makes as it writes (`AggregatingWriter.write`: of the files it has a part in,
    since issue 57's second pass; `set_up` made them all before): counted in the plan's time."""
    plans = getattr(writer, "plans", None)
    if plans is None or not hasattr(plans, "has_part"):
        return
    for file in files:
        if file.name in plans and plans.has_part(file.name, rank):
            plans[file.name]


def writer_of(rank: int, request):
    """The strategy `saving.choose_writer` takes for a folder every rank sees (the aggregating writer since issue 58,
    in place before it)."""
    try:
        from hf_unified_ckpt.checkpoint.write.aggregating import AggregatingWriter
    except ImportError:
        return save_mod.SharedFileWriter(rank)
    return AggregatingWriter(rank, request.options.aggregation)


def written_ranges(writer, file, rank: int) -> list[tuple[int, int]]:
    """(offset, length) of the ranges `rank` writes of `file`: its cells where the file is aggregated, else its
    header (on the header rank) and its items."""
    plan = getattr(writer, "plans", {}).get(file.name)
    if plan is not None:
        return [(a, b - a) for a, b in plan.cells_of(rank)]
    head = len(file.header_bytes)
    return ([(0, head)] if rank == file.header_rank else []) + \
        sorted((head + i.start, i.end - i.start) for i in file.items_of(rank) if i.end > i.start)


def records_of(mine: list, rank: int, rng: random.Random) -> list:
    """The range records rank `rank` reports of its writes (CRCs made up), and its small files'."""
    from hf_unified_ckpt.checkpoint.folder.files import RangeRecord

    out = []
    for file, ranges in mine.ranges():
        out += [RangeRecord(file.name, offset, length, rng.getrandbits(32)) for offset, length in ranges]
    return out + small_records(rank)


def simulate_rank(model: SimModel, rank: int, variant: str, folder: Path, memory: bool = False,
                  repeat: int = 1) -> dict:
    """Rank `rank`'s part of a save and of a second save: the staging folder (`open_staging`), the plan and the
    walk of the files, the conclusion (`conclude`: statuses, records, rank 0's manifest, the commit); CPU seconds
    (payload making excluded), what it received, peak memory of the first plan."""
    world = World(model)
    holder: dict = {}
    sim = SimDist(model.world, rank, world, peer_functions(), reducers(model),
                  messages(lambda: holder["files"], model.world, rank,
                           lambda: getattr(holder.get("writer"), "plans", {})))
    forget_plans()  # a first save
    saved = sim.install()
    try:
        request = request_of(variant, str(folder / f"checkpoint-{model.world}-{rank}"))
        staging = save_mod.open_staging(request.final_dir)
        gc.collect()
        if memory:
            tracemalloc.start()
        mark = len(sim.log)
        t0 = time.process_time()
        plan, mine = plan_once(sim, world(rank), request)
        first = time.process_time() - t0 - sim.excluded
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
        if memory:
            tracemalloc.stop()
        plan_log = sim.log[mark:]
        for _ in range(repeat - 1):  # the least of `repeat` first saves (this machine's CPU is shared)
            forget_plans()
            gc.collect()
            sim.excluded, t0 = 0.0, time.process_time()
            again = plan_once(sim, SimEngine(model, rank), request)
            first = min(first, time.process_time() - t0 - sim.excluded)
            del sim.log[mark + len(plan_log):]
        if repeat > 1:
            plan, mine = again
        holder["files"], holder["writer"] = plan.files, mine.writer
        started = save_mod.Started(request, staging, plan, save_mod.SharedFileWriter(rank), [], None)
        records = records_of(mine, rank, random.Random(rank))
        sim.excluded, mark = 0.0, len(sim.log)
        t0 = time.process_time()
        reports = save_mod.conclude(started, (True, records))
        concluded = time.process_time() - t0 - sim.excluded
        assert all(ok for ok, _ in reports), reports
        conclude_log = sim.log[mark:]
        sim.excluded, mark = 0.0, len(sim.log)
        first_save = list(sim.log)
        cached = math.inf
        for _ in range(repeat):
            gc.collect()
            sim.excluded, t0 = 0.0, time.process_time()
            plan_once(sim, SimEngine(model, rank), request)  # an adapter per save, as the Trainer makes them
            cached = min(cached, time.process_time() - t0 - sim.excluded)
            cached_log = sim.log[mark:]
            mark = len(sim.log)
    finally:
        restore(saved)
    return {"plan": plan, "mine": mine, "plan_s": first, "plan_cached_s": cached, "peak": peak,
            "conclude_s": concluded, "log": first_save, "plan_log": plan_log,
            "conclude_log": conclude_log, "cached_log": cached_log, "exchanged": world(rank).exchanged}


class _Bytes:
    """A memoryview stand-in with a length only (the run cutter slices, never reads)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> "_Bytes":
        return _Bytes(len(range(*index.indices(self.n))))


def write_calls(mine: Walk, rank: int) -> dict | None:
    """Drive the direct writer's run cutting (`store.direct._Runs`) with this rank's ranges, file by file: the
    bytes in direct calls of at least 8 MiB, and the calls not 4 KiB-aligned (offset or length), in all and in the
    file with most (None: the rank writes nothing)."""
    import inspect

    from hf_unified_ckpt.store import direct

    calls, current = [], [None]
    takes_index = "index" in inspect.signature(direct._Runs.add).parameters  # older revisions (measured too): not

    class Pool:
        chunk = direct.CHUNK
        parts: list = []  # the writer's checksums of its parts (none here: no byte exists)

        def submit(self, offset, length, pieces):
            calls.append((current[0], offset, length))

    saved = direct.pwrite_all, getattr(direct, "crc32", None)
    direct.pwrite_all = lambda fd, data, offset: calls.append((current[0], offset, len(data)))
    direct.crc32 = lambda data, *start: 0
    try:
        for file, ranges in mine.ranges():
            current[0] = file.name
            runs = direct._Runs(-1, Pool())
            for index, (offset, length) in enumerate(ranges):
                runs.add(offset, _Bytes(length), *([index] if takes_index else []))
            runs.close_run()
    finally:
        direct.pwrite_all, direct.crc32 = saved
    total = sum(n for _, _, n in calls)
    if not total:
        return None
    unaligned = collections.Counter(f for f, o, n in calls if o % 4096 or n % 4096)
    return {"big_fraction": sum(n for _, _, n in calls if n >= 8 * MiB) / total,
            "unaligned": sum(unaligned.values()), "unaligned_per_file": max(unaligned.values(), default=0)}


def writers_max(files: list, writer) -> int:
    """The most ranks writing one file: its aggregators where it is aggregated, else its header rank and the
    holders of its pieces (from the plan's closed forms or its listed pieces)."""
    from hf_unified_ckpt.format.aggregation import writers_of

    plans = getattr(writer, "plans", {})
    return max((len(set(plans[f.name].aggregators)) if f.name in plans else writers_of(f) for f in files),
               default=1)


def s3_ratio(files: list, max_files: int, writer) -> tuple[float, int]:
    """A bucket save's hand-overs: per rank, bytes received from other ranks over bytes uploaded, the largest, over
    at most `max_files` files spread over the checkpoint: parts of aggregators where the multipart writer
    aggregates the file, else its holders' runs (`format.parts.plan_parts`)."""
    from hf_unified_ckpt.format.parts import file_runs, plan_parts
    from hf_unified_ckpt.store.s3 import MIN_PART_SIZE, PART_SIZE

    step = max(1, len(files) // max_files)
    received, uploaded, used = {}, {}, 0
    for index, file in enumerate(files[::step][:max_files]):
        try:
            agg = bucket_plan(file, writer, index, MIN_PART_SIZE, PART_SIZE)
            if agg is not None:
                for r in set(agg.aggregators):
                    uploaded[r] = uploaded.get(r, 0) + sum(b - a for a, b in agg.cells_of(r))
                    received[r] = received.get(r, 0) + sum(h.end - h.start for h in agg.received_by(r))
                used += 1
                continue
            parts = plan_parts(file_runs(file), MIN_PART_SIZE, PART_SIZE)
        except LookupError:  # a rank-local piece (the residual's ties): a bucket save takes the census
            continue
        used += 1
        for p in parts.parts:
            uploaded[p.uploader] = uploaded.get(p.uploader, 0) + p.end - p.start
        for h in parts.hand_overs:
            received[h.receiver] = received.get(h.receiver, 0) + h.end - h.start
    ratio = max((received.get(r, 0) / up for r, up in uploaded.items() if up), default=0.0)
    return ratio, used


def bucket_plan(file, writer, index: int, min_part: int, part_size: int):
    """The aggregated part plan the multipart writer takes for `file` (None: the holders upload their runs)."""
    try:
        from hf_unified_ckpt.format.aggregation import aggregate, wants_aggregation
    except ImportError:
        return None
    layout = getattr(writer, "layout", None)
    if layout is None or not wants_aggregation(file, layout, writer.options.mode):
        return None
    return aggregate(file, layout, index, min_range=min_part, cell_bytes=part_size)


def received(log: list) -> int:
    return sum(b for _, _, b in log)


def run_row(row: Row, args, folder: Path) -> dict:
    params = llama_params(MODELS[row.model])
    master = row.engine.startswith("zero") or row.engine == "mics"
    model = SimModel(row.engine, row.ranks, params, master)
    sample = sorted({0, row.ranks // 2, row.ranks - 1})
    runs = {r: simulate_rank(model, r, row.variant, folder, repeat=args.repeat) for r in sample}
    mem = simulate_rank(model, row.ranks - 1, row.variant, folder, memory=True)["peak"] if args.memory else 0
    files, writer = runs[0]["plan"].files, runs[0]["mine"].writer
    others = [r for r in sample if r] or [0]
    writes = [w for r, run in runs.items() if (w := write_calls(run["mine"], r)) is not None]
    ratio, s3_files = s3_ratio(files, args.s3_files, writer)
    collectives = {}
    for r in others[-1:]:
        for kind, caller, b in runs[r]["log"]:
            collectives[f"{kind}:{caller}"] = collectives.get(f"{kind}:{caller}", 0) + b
    return {
        "model": row.model, "engine": row.engine, "variant": row.variant, "ranks": row.ranks,
        "plan_s": round(max(r["plan_s"] for r in runs.values()), 4),
        "plan_cached_s": round(max(r["plan_cached_s"] for r in runs.values()), 4),
        "plan_peak_mib": round(mem / MiB, 1),
        "received_per_rank_bytes": max(received(runs[r]["log"]) for r in others),
        "rank0_received_bytes": received(runs[0]["log"]),
        "rank0_s": round(runs[0]["conclude_s"], 4),
        "files": len(files), "writers_per_file_max": writers_max(files, writer),
        "aggregated_files": len(getattr(writer, "plans", {})),
        "write_bytes_ge_8mib_fraction": round(min((w["big_fraction"] for w in writes), default=0.0), 4),
        "unaligned_calls": max((w["unaligned"] for w in writes), default=0),
        "unaligned_calls_per_file_max": max((w["unaligned_per_file"] for w in writes), default=0),
        "s3_received_over_uploaded": round(ratio, 4), "s3_files_sampled": s3_files,
        "collectives_last_rank": collectives,
        "cached_save_collectives": sorted({f"{k}:{c}" for k, c, _ in runs[others[-1]]["cached_log"]}),
        "assembled_tensors": runs[others[-1]]["exchanged"], "sampled_ranks": sample,
        **({"ties_data_s": round(max(ties_data_s(model, r) for r in sample), 4)} if row.variant == "residual" else {}),
    }


def ties_data_s(model: SimModel, rank: int, sample: int = 2**22) -> float:
    """The data pass of the residual census over rank `rank`'s real master elements (the simulated fragments hold 8
    elements each, so `plan_cached_s` has the per-fragment work but not this): `count_ties_many` timed (one intra-op
    thread, the least of 3) over random elements cut like the rank's fragments up to `sample` elements, scaled to
    all of them. It shrinks as 1/N (the rank's share of the parameters), like the writes of the rank's bytes."""
    from hf_unified_ckpt.format.codecs import count_ties_many

    sizes = [model.piece(n, rank)[1] if n in model.rule else model.numel[n] for n, _ in model.params]
    total, cut, left = sum(sizes), [], sample
    for n in sizes:
        if n and left:
            cut.append(min(n, left))
            left -= cut[-1]
    x = torch.randn(sum(cut))
    low, at, fragments = x.to(torch.bfloat16), 0, []
    for i, n in enumerate(cut):
        fragments.append((i, x[at:at + n], low[at:at + n]))
        at += n
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = math.inf
        for _ in range(3):
            t0 = time.process_time()
            count_ties_many(fragments)
            best = min(best, time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return best * total / max(1, sum(cut))


def entries_of(row: Row) -> int:
    """Peer entries today's census makes on one rank (N x sharded tensors): the size of a row."""
    cfg = MODELS[row.model]
    tensors = (cfg["layers"] * 9 + 3) * (4 if row.engine != "fsdp2" else 3)
    return 0 if row.engine == "ddp" else row.ranks * tensors


def exponent(rows: list[dict], key: str, lo: int = 512, hi: int = 16384) -> float | None:
    a = next((r for r in rows if r["ranks"] == lo), None)
    b = next((r for r in rows if r["ranks"] == hi), None)
    if not a or not b or not a[key] or not b[key]:
        return None
    return round(math.log(b[key] / a[key]) / math.log(hi / lo), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8b,70b,405b")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--ranks", default="8,64,512,2048,16384")
    parser.add_argument("--variants", default="plain,o1,residual",
                        help="plain: bf16+fp32 state; o1: O1 moment codec; residual: residual master weights")
    parser.add_argument("--max-entries", type=float, default=3e6,
                        help="skip rows whose simulation would gather more peer entries than this (today's code)")
    parser.add_argument("--s3-files", type=int, default=8)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--repeat", type=int, default=3, help="plan timings: the least of this many")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gc.collect()
    gc.freeze()  # the imported modules' objects (~170,000: torch's), as support.env.freeze_imports does; see the doc
    rows = []
    for model in args.model.split(","):
        for engine in args.engines.split(","):
            for variant in args.variants.split(","):
                if variant == "residual" and not engine.startswith("zero"):
                    continue  # master weights of their own: DeepSpeed bf16 only
                for ranks in (int(n) for n in args.ranks.split(",")):
                    row = Row(model, engine, variant, ranks)
                    if entries_of(row) > args.max_entries and row.engine == "mics":
                        print(json.dumps({**dataclasses.asdict(row), "skipped": "too large to simulate the census "
                                          f"census ({entries_of(row):.2g} peer entries)"}), flush=True)
                        continue
                    with tempfile.TemporaryDirectory() as folder:
                        out = run_row(row, args, Path(folder))
                    rows.append(out)
                    print(json.dumps(out) if args.json else
                          f"{model} {engine} {variant} N={ranks}: plan {out['plan_s']:.3f} s (cached "
                          f"{out['plan_cached_s']:.3f}), {out['plan_peak_mib']} MiB, received "
                          f"{out['received_per_rank_bytes'] / MiB:.2f} MiB (rank 0 "
                          f"{out['rank0_received_bytes'] / MiB:.2f}), rank 0 {out['rank0_s']:.3f} s", flush=True)
    for model in args.model.split(","):
        for engine in args.engines.split(","):
            for variant in args.variants.split(","):
                group = [r for r in rows if (r["model"], r["engine"], r["variant"]) == (model, engine, variant)]
                exps = {k: exponent(group, k) for k in ("plan_s", "plan_peak_mib", "received_per_rank_bytes",
                                                         "rank0_received_bytes", "rank0_s", "files")}
                if exps["plan_s"] is not None and exps["files"] is not None:  # the first plan's work per file
                    exps["plan_s_per_file"] = round(exps["plan_s"] - exps["files"], 3)
                if any(v is not None for v in exps.values()):
                    print(json.dumps({"exponents_512_to_16384": exps, "model": model, "engine": engine,
                                      "variant": variant}), flush=True)


if __name__ == "__main__":
    main()
