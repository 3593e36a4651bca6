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
  (unpickling what a rank receives is included). Rank 0 and the last rank are run; the larger is reported.
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
smallest to the largest of the rows at 512 and 16,384 ranks) are printed at the end.

This differs from `bench_scaling.py`, which launches real ranks (2-4 here) and times real saves: this one runs no
I/O and no real collective; it measures the save's metadata work and traffic where launches cannot go.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pickle
import random
import sys
import time
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hf_unified_ckpt import dist as real_dist  # noqa: E402
from hf_unified_ckpt.checkpoint import save as save_mod  # noqa: E402
from hf_unified_ckpt.engines.base import Fragment  # noqa: E402
from hf_unified_ckpt.format.components import MASTER, MODEL, OPTIMIZER, saved_by  # noqa: E402
from hf_unified_ckpt.format.names import optimizer_key, split_optimizer_key  # noqa: E402
from hf_unified_ckpt.format.planning import TensorSpec  # noqa: E402
from hf_unified_ckpt.options import UnifiedCheckpointOptions  # noqa: E402

MiB = 2**20
MODELS = {  # Llama-3 / 3.1 public configs
    "8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256),
    "405b": dict(hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, vocab=128256),
}
ENGINES = ("zero12", "zero3", "fsdp2", "ddp")
STATES = ("exp_avg", "exp_avg_sq")


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
        self.offset, self.partition = {}, {}
        if self.engine == "zero12":  # the Trainer's groups: weights with decay, then the norms without
            groups = [[n for n, s in self.params if len(s) > 1], [n for n, s in self.params if len(s) == 1]]
            for g, names in enumerate(groups):
                total, at = sum(self.numel[n] for n in names), 0
                padded = -(-total // (2 * self.world)) * 2 * self.world
                for n in names:
                    self.offset[n], self.partition[n] = (g, at), padded // self.world
                    at += self.numel[n]

    def piece(self, name: str, rank: int) -> tuple[int, int] | None:
        """(first element, count) rank `rank` holds of parameter `name` (None: it holds it whole)."""
        n, N = self.numel[name], self.world
        if self.engine == "ddp":
            return None
        if self.engine == "zero3":
            size = -(-n // N)
            first = min(rank * size, n)
            return first, max(0, min(n, first + size) - first)
        if self.engine == "fsdp2":
            rows = self.shape[name][0]
            per = -(-rows // N)
            row_elems = n // rows
            r0, r1 = min(rank * per, rows), min((rank + 1) * per, rows)
            return r0 * row_elems, (r1 - r0) * row_elems
        _, at = self.offset[name]
        size = self.partition[name]
        lo, hi = max(at, rank * size), min(at + n, (rank + 1) * size)
        return (lo - at, hi - lo) if hi > lo else (0, 0)


class SimEngine:
    """An `EngineAdapter` for planning only: specs, owners, fragments (`Lazy` values) of one rank of a `SimModel`.
    Its methods mirror the real adapters' (engines/deepspeed.py, fsdp.py, replicated.py) where they communicate."""

    def __init__(self, model: SimModel, rank: int):
        self.model, self.rank = model, rank
        self.engine = {"zero12": "deepspeed-zero2", "zero3": "deepspeed-zero3", "fsdp2": "fsdp",
                       "ddp": "ddp"}[model.engine]
        self._frag_sizes = None
        self.exchanged = 0

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
        sizes = self._fragment_sizes()
        owner = {n: max(range(len(s)), key=lambda r: (s[r], -r)) for n, s in sizes.items()}
        if component == MODEL.name:
            return {}
        return {s.name: owner[split_optimizer_key(s.name)[0] if component == OPTIMIZER.name else s.name]
                for s in self.specs(component)}

    def master_fragments(self):
        """(name, fp32 elements, bf16 elements) of this rank's master fragments: a few real elements each (the
        census counts ties; their number does not change the payload's shape)."""
        for name, frag in self.fragments(MASTER.name).items():
            n = min(frag.values.numel(), 8)
            if n:
                hp = torch.linspace(-1, 1, n)
                yield name, hp, hp.to(torch.bfloat16)

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
    collective this rank takes part in (`log`: (kind, caller, bytes received)); an object collective's other
    payloads come from running the caller again as rank q (`peers`), where that collective raises `Captured`."""

    def __init__(self, world: int, me: int, engines, peers: dict):
        self.world, self.me, self.engines, self.peers = world, me, engines, peers
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

    def _caller(self) -> tuple[str, dict]:
        frame = sys._getframe(2)
        return frame.f_code.co_name, frame.f_locals

    def _peer(self, caller: str, local: dict, q: int):
        """Rank q's payload at this collective."""
        if q == self.me:
            raise AssertionError
        make = self.peers.get(caller)
        if make is None:
            raise KeyError(f"the simulation has no peer payload for a collective in {caller}()")
        saved, self.me, self.capture = self.me, q, True
        try:
            make(self.engines(q), local)
        except Captured as c:
            return c.payload
        finally:
            self.me, self.capture = saved, False
        raise AssertionError(f"{caller}() reached no collective as rank {q}")

    def all_gather_object(self, obj, group=None) -> list:
        if self.capture:
            raise Captured(obj)
        caller, local = self._caller()
        t0 = time.process_time()
        out = [None] * self.world
        sizes = []
        for q in range(self.world):
            payload = obj if q == self.me else self._peer(caller, local, q)
            data = pickle.dumps(payload)
            sizes.append(len(data))
            out[q] = data
        self.excluded += time.process_time() - t0
        out = [pickle.loads(d) for d in out]  # the receiver's own work
        self.log.append(("all_gather_object", caller, self.world * (8 + max(sizes))))
        return out

    def broadcast_object(self, obj, src: int = 0, group=None):
        if self.capture:
            raise Captured(obj)
        caller, local = self._caller()
        if self.me != src:
            t0 = time.process_time()
            obj = self._peer(caller, local, src)
            data = pickle.dumps(obj)
            self.excluded += time.process_time() - t0
            obj = pickle.loads(data)
            self.log.append(("broadcast_object", caller, 8 + len(data)))
        else:
            self.log.append(("broadcast_object", caller, 0))
        return obj

    def cpu_group(self):
        return None

    def gloo_group(self, purpose: str):
        return None

    def install(self):
        """Put this simulation in place of `hf_unified_ckpt.dist`'s functions; returns what to put back."""
        names = [n for n in ("rank", "world_size", "is_distributed", "barrier", "all_gather_object",
                             "broadcast_object", "cpu_group", "gloo_group") if hasattr(real_dist, n)]
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
    }


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


def plan_once(sim: SimDist, engine: SimEngine, request) -> tuple[object, list]:
    """One rank's planning on the training thread, as `save.begin` does it (the staging folder aside)."""
    plan = save_mod.plan_save(engine, request, shared=True)
    writer = save_mod.SharedFileWriter(sim.me)
    files = plan.files
    writer.prepare("sim", files)
    mine = []
    for file in files:
        writer.assemble(engine, file)
        if writer.writes(file, sim.me):
            mine.append((file, file.items_of(sim.me), file.pieces_held(sim.me)))
    return plan, mine


def timed_plan(model: SimModel, rank: int, request, memory: bool = False) -> dict:
    """Plan one rank's first and second save; CPU seconds (payload making excluded), collectives, peak memory."""
    world = World(model)
    engine = world(rank)
    sim = SimDist(model.world, rank, world, peer_functions())
    saved = sim.install()
    try:
        gc.collect()
        if memory:
            tracemalloc.start()
        t0 = time.process_time()
        plan, mine = plan_once(sim, engine, request)
        first = time.process_time() - t0 - sim.excluded
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
        if memory:
            tracemalloc.stop()
        log_first = list(sim.log)
        sim.excluded = 0.0
        t0 = time.process_time()
        plan_once(sim, engine, request)
        cached = time.process_time() - t0 - sim.excluded
    finally:
        restore(saved)
    return {"plan": plan, "mine": mine, "plan_s": first, "plan_cached_s": cached, "peak": peak, "log": log_first,
            "exchanged": engine.exchanged}


def records_of(files, rank: int, rng: random.Random) -> list:
    """The range records rank `rank` reports of its writes (CRCs made up)."""
    from hf_unified_ckpt.checkpoint.files import RangeRecord

    out = []
    for file in files:
        head = len(file.header_bytes)
        if rank == file.header_rank:
            out.append(RangeRecord(file.name, 0, head, rng.getrandbits(32)))
        for item in file.items_of(rank):
            out.append(RangeRecord(file.name, head + item.start, item.end - item.start, rng.getrandbits(32)))
    return out


def conclude_cost(plan, model: SimModel, sample: list[int]) -> dict:
    """What concluding a save costs with today's records (every rank's records to every rank, rank 0 combines
    them): the bytes each rank receives, rank 0's CPU seconds (combine and manifest)."""
    from hf_unified_ckpt.checkpoint.files import FileRecord, RangeRecord, combine_ranges
    from hf_unified_ckpt.checkpoint.manifest import ComponentEntry, build_manifest

    files = plan.files
    rng = random.Random(0)
    by_rank: dict[int, list] = {}
    for file in files:
        head = len(file.header_bytes)
        by_rank.setdefault(file.header_rank, []).append(RangeRecord(file.name, 0, head, rng.getrandbits(32)))
        for item in file.items:
            by_rank.setdefault(item.rank, []).append(
                RangeRecord(file.name, head + item.start, item.end - item.start, rng.getrandbits(32)))
    small = {r: [FileRecord(f"rng_state_{r}.pth", 14583, f"{rng.getrandbits(32):08x}")] for r in range(model.world)}
    biggest = max(len(pickle.dumps((True, by_rank.get(r, []) + small[r]))) for r in range(model.world))
    received = model.world * (8 + biggest)  # conclude: every rank's outcome to every rank
    received += 8 + len(pickle.dumps((True, {})))  # rank 0's status, broadcast
    received += model.world * (8 + len(pickle.dumps((True, None))))  # every folder's commit, gathered
    # open_staging: rank 0's (status, attempt) broadcast; every rank's (joined, sees rank 0's folder) gathered
    received += 8 + len(pickle.dumps(((True, (None, None, None)), "0" * 32)))
    received += model.world * (8 + len(pickle.dumps(((True, None), True))))
    t0 = time.process_time()
    records = [r for q in range(model.world) for r in by_rank.get(q, [])]
    sizes = {f.name: f.size for f in files}
    combined = combine_ranges(sizes, records) + [r for q in range(model.world) for r in small[q]]
    entries = {n: ComponentEntry(c.file_stem, tuple(c.files), None, len(c.specs), c.total_size, None)
               for n, c in plan.components.items()}
    build_manifest(1, plan.saved_by, {}, entries, combined)
    rank0_s = time.process_time() - t0
    writers = {}
    for file in files:
        writers[file.name] = len({i.rank for i in file.items} | {file.header_rank})
    return {"received": received, "rank0_s": rank0_s, "writers_per_file_max": max(writers.values()),
            "files": len(files), "records": len(records)}


class _Bytes:
    """A memoryview stand-in with a length only (the run cutter slices, never reads)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> "_Bytes":
        return _Bytes(len(range(*index.indices(self.n))))


def write_calls(mine: list, rank: int) -> dict:
    """Drive the direct writer's run cutting (`store.direct._Runs`) with this rank's ranges, file by file: the
    bytes in direct calls of at least 8 MiB, and the calls not 4 KiB-aligned."""
    from hf_unified_ckpt.store import direct

    calls = []

    class Pool:
        chunk = direct.CHUNK

        def submit(self, offset, length, pieces):
            calls.append((offset, length))

    saved = direct.pwrite_all
    direct.pwrite_all = lambda fd, data, offset: calls.append((offset, len(data)))
    try:
        for file, items, _ in mine:
            runs = direct._Runs(-1, Pool())
            head = len(file.header_bytes)
            ranges = ([(0, head)] if rank == file.header_rank else []) + \
                sorted((head + i.start, i.end - i.start) for i in items)
            for offset, length in ranges:
                runs.add(offset, _Bytes(length))
            runs.close_run()
    finally:
        direct.pwrite_all = saved
    total = sum(n for _, n in calls) or 1
    return {"big_fraction": sum(n for _, n in calls if n >= 8 * MiB) / total,
            "unaligned": sum(1 for o, n in calls if o % 4096 or n % 4096)}


def s3_ratio(plan, max_files: int) -> tuple[float, int]:
    """A bucket save's hand-overs: per rank, bytes received from other ranks over bytes uploaded, the largest, over
    at most `max_files` files spread over the checkpoint."""
    from hf_unified_ckpt.format.parts import file_runs, plan_parts
    from hf_unified_ckpt.store.s3 import MIN_PART_SIZE, PART_SIZE

    files = plan.files
    step = max(1, len(files) // max_files)
    chosen = files[::step][:max_files]
    received, uploaded = {}, {}
    for file in chosen:
        parts = plan_parts(file_runs(file), MIN_PART_SIZE, PART_SIZE)
        for p in parts.parts:
            uploaded[p.uploader] = uploaded.get(p.uploader, 0) + p.end - p.start
        for h in parts.hand_overs:
            received[h.receiver] = received.get(h.receiver, 0) + h.end - h.start
    ratio = max((received.get(r, 0) / up for r, up in uploaded.items() if up), default=0.0)
    return ratio, len(chosen)


def run_row(row: Row, args) -> dict:
    params = llama_params(MODELS[row.model])
    master = row.engine.startswith("zero")
    model = SimModel(row.engine, row.ranks, params, master)
    request = request_of(row.variant, "/sim/checkpoint-1")
    last = row.ranks - 1
    runs = {r: timed_plan(model, r, request) for r in sorted({0, last})}
    mem = timed_plan(model, last, request, memory=True)["peak"] if args.memory else 0
    plan = runs[0]["plan"]
    concluded = conclude_cost(plan, model, [0, last])
    received = {r: sum(b for _, _, b in run["log"]) + concluded["received"] for r, run in runs.items()}
    writes = [write_calls(run["mine"], r) for r, run in runs.items()]
    ratio, s3_files = s3_ratio(plan, args.s3_files)
    collectives = {}
    for kind, caller, b in runs[last]["log"]:
        collectives[f"{kind}:{caller}"] = collectives.get(f"{kind}:{caller}", 0) + b
    return {
        "model": row.model, "engine": row.engine, "variant": row.variant, "ranks": row.ranks,
        "plan_s": round(max(r["plan_s"] for r in runs.values()), 4),
        "plan_cached_s": round(max(r["plan_cached_s"] for r in runs.values()), 4),
        "plan_peak_mib": round(mem / MiB, 1),
        "received_per_rank_bytes": received[last] if last else received[0],
        "rank0_received_bytes": received[0],
        "rank0_s": round(concluded["rank0_s"], 4),
        "files": concluded["files"], "writers_per_file_max": concluded["writers_per_file_max"],
        "write_bytes_ge_8mib_fraction": round(min(w["big_fraction"] for w in writes), 4),
        "unaligned_calls": max(w["unaligned"] for w in writes),
        "s3_received_over_uploaded": round(ratio, 4), "s3_files_sampled": s3_files,
        "collectives_last_rank": collectives, "assembled_tensors": runs[last]["exchanged"],
        "sampled_ranks": sorted(runs),
    }


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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for model in args.model.split(","):
        for engine in args.engines.split(","):
            for variant in args.variants.split(","):
                if variant == "residual" and not engine.startswith("zero"):
                    continue  # master weights of their own: DeepSpeed bf16 only
                for ranks in (int(n) for n in args.ranks.split(",")):
                    row = Row(model, engine, variant, ranks)
                    if entries_of(row) > args.max_entries and not getattr(save_mod, "RULE_PLANNING", False):
                        print(json.dumps({**dataclasses.asdict(row), "skipped": "too large to simulate today's "
                                          f"census ({entries_of(row):.2g} peer entries)"}), flush=True)
                        continue
                    out = run_row(row, args)
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
                                                         "rank0_received_bytes", "rank0_s")}
                if any(v is not None for v in exps.values()):
                    print(json.dumps({"exponents_512_to_16384": exps, "model": model, "engine": engine,
                                      "variant": variant}), flush=True)


if __name__ == "__main__":
    main()
