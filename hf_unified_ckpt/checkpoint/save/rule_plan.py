"""The pieces of a save from the engine's partition rule, not from a census (issue 57).

An engine whose layout follows a known rule (DeepSpeed ZeRO-1/2/3, FSDP2's Shard(0), replicated) gives it in closed
form (`partition_rule(component)`: tensor name -> `planning.Strided`); every rank then knows every rank's piece in
O(1) without asking. At a save, each rank checks that the pieces it really holds are the rule's for it
(`rule_matches`), and the ranks agree in one all-reduce (MIN) of [plan cached, rule matches, digest, -digest]
(`agree`): the digest covers what the plan depends on (world size, engine, specs, the rule, the options), so a rank
planning differently is seen. Where every rank matches, the plan is made from the rule and cached (`remember`)
for the next saves of the same digest; where the engine declares no rule (HSDP, MiCS, tensor or expert
parallelism) or any rank's pieces differ from it, the save gathers every rank's pieces (`saving.census_of_pieces`),
which is said once per process.

With the rule, what the census also carried goes point to point: the O1/O2 codec's halos (`exchange_halos`: each
rank's first elements before its first block go to the one rank whose last block needs them), and the residual
codec's ties (`residual_census`: counts summed by an all-reduce; each rank's offset by an exclusive scan).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import marshal

import torch

from ... import dist
from ...engines.base import MasterFragments, PartitionRule
from ...format.codecs import ResidualCodec, count_ties_many
from ...format.planning import ComponentPlan, HaloEncoder, Strided

logger = logging.getLogger(__name__)

#: Plans made from a rule, by (rank, digest): only the latest is kept.
_CACHE: dict[tuple[int, int], object] = {}
_SAID: set[str] = set()


@dataclasses.dataclass
class Rule:
    """The rule's pieces of every component (name -> tensor -> `Strided`), the digest of the plan's inputs, and
    the plan cached for this digest (None: plan it)."""

    pieces: dict[str, dict[str, Strided]]
    digest: int
    cached: object | None = None


def rules_of(engine, components, specs: dict | None = None) -> tuple[dict | None, str]:
    """Every component's closed-form pieces (`engine.partition_rule`), or (None, why not); `specs`: the engine's of
    each component, where the caller has them. Local."""
    if not isinstance(engine, PartitionRule):
        return None, f"{type(engine).__name__} declares no partition rule"
    declared = engine.partition_rule
    out, why = {}, ""
    for c in components:
        rule, why = declared(c.name, [s.name for s in specs[c.name]]) if specs else declared(c.name)
        if rule is None:
            return None, why
        out[c.name] = rule
    return out, why


def rule_matches(engine, rules: dict, rank: int) -> bool:
    """Whether the pieces this rank holds (`engine.fragments`) are the rule's pieces for it, tensor by tensor.
    Local."""
    for component, rule in rules.items():
        held = engine.fragments(component)
        for name, fragment in held.items():
            count = fragment.values.numel()
            first, expected = rule[name].of(rank) if name in rule else (0, 0)
            if count != expected or (count and fragment.start != first):
                return False
        if any(rule[n].of(rank)[1] for n in rule if n not in held):
            return False
    return True


def digest_of(engine, components, request, shared: bool, rules: dict | None, specs: dict | None = None) -> int:
    """A 63-bit digest of what the plan depends on: world size, engine, every component (name, file stem, role) and
    its specs (`specs`: the engine's, where the caller has them), the rule, the options that shape files. The same
    on every rank that would plan the same. Local."""
    h = hashlib.blake2b(digest_size=8)
    options = request.options
    h.update(repr((dist.world_size(), engine.engine, shared,
                   request.include_optimizer, options.quant_stage, options.residual_master_weight,
                   options.max_shard_size)).encode())
    for c in components:  # marshal's version 2: the bytes of the values alone (no back-references)
        h.update(repr((c.name, c.file_stem, str(c.role))).encode())
        held = engine.specs(c.name) if specs is None else specs[c.name]
        dtypes = {d: str(d) for d in {s.dtype for s in held}}  # (`str` of a dtype is a string operation)
        h.update(marshal.dumps([(s.name, tuple(s.shape), dtypes[s.dtype]) for s in held], 2))
        if rules is not None:  # in the rule's order: the specs' order, the same on every rank
            h.update(marshal.dumps([(n, s.numel, s.size, s.shift) for n, s in rules[c.name].items()], 2))
    return int.from_bytes(h.digest(), "little") >> 1


def agree(engine, components, request, shared: bool) -> Rule | None:
    """The rule every rank follows, with the plan cached for it if every rank has one, or None (the save takes the
    census; said once per process and reason). Collective: one all-reduce of four integers."""
    specs = {c.name: engine.specs(c.name) for c in components}  # asked once: the adapter makes them anew per call
    rules, why = rules_of(engine, components, specs)
    digest = digest_of(engine, components, request, shared, rules, specs)
    me = dist.rank()
    cached = _CACHE.get((me, digest)) if rules is not None else None
    match = rules is not None and (cached is not None or rule_matches(engine, rules, me))
    hit, matched, low, high = dist.all_reduce_ints([int(cached is not None), int(match), digest, -digest], "min")
    if matched and low == -high:
        return Rule(rules, digest, cached if hit else None)
    if rules is not None:
        why = ("the pieces some rank holds are not the partition rule's" if not matched
               else "the ranks' plans differ (specs, options or world size)")
    if why not in _SAID and dist.world_size() > 1:
        _SAID.add(why)
        if me == 0:
            logger.warning("Planning this save gathers every rank's pieces (O(ranks x tensors) per rank): %s.", why)
    return None


def remember(rule: Rule, plan) -> None:
    """Cache `plan` for the next saves of the same digest (this rank's; the previous one is dropped)."""
    _CACHE.clear()
    _CACHE[(dist.rank(), rule.digest)] = plan


def pieces_of(rule: Rule, plans: dict[str, ComponentPlan]) -> dict[str, dict[str, Strided]]:
    """The pieces of every planned tensor the rule splits (empty tensors are written whole)."""
    return {name: {t: s for t, s in rule.pieces.get(name, {}).items() if t in cplan.specs and s.numel}
            for name, cplan in plans.items()}


def exchange_halos(engine, plans: dict[str, ComponentPlan], pieces: dict[str, dict[str, Strided]],
                   group=None) -> None:
    """Give every codec that encodes blocks across pieces (`HaloEncoder`) the halos its rank needs: each rank
    sends the elements it holds ahead of its first block start to the rank that holds that block's start (whose
    last block they complete), all tensors to one rank in one message. Tensors split alike (the same numel and
    rule: a layer's norms, a parameter's moments) go as one group, in the order both sides walk them.
    Collective (point-to-point between neighbours in element order): all ranks must call it."""
    me = dist.rank()
    sends: dict[int, list[torch.Tensor]] = {}
    wanted: dict[int, list[tuple[str, tuple[str, ...], int, int]]] = {}  # source -> (component, tensors, first, n)
    for component, cplan in plans.items():
        codec = cplan.codec
        if not isinstance(codec, HaloEncoder):
            continue
        rules = pieces[component]
        names = sorted((n for n in codec.tensors if n in rules), key=lambda n: (_alike(rules[n]), n))
        held = engine.fragments(component, names) if names else {}
        for _, alike in itertools.groupby(names, key=lambda n: _alike(rules[n])):
            alike = tuple(alike)
            rule, block = rules[alike[0]], codec.block
            first, count = rule.of(me)
            if not count:
                continue
            ahead = min(count, -(-first // block) * block - first)
            if ahead > 0:
                sends.setdefault(rule.rank_of(first // block * block), []).extend(
                    held[n].values[:ahead].detach().to(torch.float32).reshape(-1) for n in alike)
            for source, start, n in _halo_sources(rule, first, count, block):
                wanted.setdefault(source, []).append((component, alike, start, n))
    received = dist.exchange_tensors({dst: torch.cat(parts) for dst, parts in sends.items()},
                                      {src: (sum(len(a) * n for _, a, _, n in w), torch.float32)
                                       for src, w in wanted.items()}, group=group) if sends or wanted else {}
    collected = _by_tensor(wanted, received)
    halos: dict[str, dict[str, dict[int, torch.Tensor]]] = {c: {} for c in plans}
    for (component, name), got in collected.items():  # the pieces after this rank's, in element order: one halo
        got.sort(key=lambda g: g[0])
        halos[component][name] = {got[0][0]: torch.cat([c for _, c in got]) if len(got) > 1 else got[0][1]}
    for component, cplan in plans.items():
        if isinstance(cplan.codec, HaloEncoder):
            cplan.codec.receive_halos(halos[component])


def _alike(rule: Strided) -> tuple[int, int, int]:
    return rule.numel, rule.size, rule.shift


def _by_tensor(wanted: dict, received: dict) -> dict[tuple[str, str], list[tuple[int, torch.Tensor]]]:
    """The received halos by tensor: (first element, elements) per run of sources. Consecutive sources that sent
    the same layout (pieces smaller than a block: many ranks to one block) are stacked, and each group of tensors
    split alike is cut by one reshape into a halo per tensor (in element order: source after source)."""
    layouts: dict[tuple, list[int]] = {}
    for source, parts in wanted.items():
        layouts.setdefault(tuple((c, a, k) for c, a, _, k in parts), []).append(source)
    out: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for layout, sources in layouts.items():
        sources.sort()
        runs, run = [], [sources[0]]
        for source in sources[1:]:
            if source == run[-1] + 1:
                run.append(source)
            else:
                runs.append(run)
                run = [source]
        runs.append(run)
        for run in runs:
            stacked, at = torch.stack([received[s] for s in run]), 0
            for component, alike, start, k in wanted[run[0]]:
                rows = stacked[:, at:at + len(alike) * k].reshape(len(run), len(alike), k).transpose(0, 1)
                for name, row in zip(alike, rows.reshape(len(alike), len(run) * k)):
                    out.setdefault((component, name), []).append((start, row))
                at += len(alike) * k
    return out


def _halo_sources(rule: Strided, first: int, count: int, block: int) -> list[tuple[int, int, int]]:
    """(rank, its first element, elements) of the halos that complete this rank's last block (none when no block
    starts among its elements or its last block ends within them)."""
    k0, k1 = -(-first // block), -(-(first + count) // block)
    end, stop = first + count, min(k1 * block, rule.numel)
    if k1 <= k0 or end >= stop:
        return []
    size, shift = rule.size, rule.shift
    out = []
    for source in range(rule.rank_of(end), rule.rank_of(stop - 1) + 1):
        start = max(end, source * size - shift)
        out.append((source, start, min(stop, (source + 1) * size - shift) - start))
    return out


def residual_census(engine, names: list[str], group=None) -> ResidualCodec:
    """The residual codec of the master weights from a census without a gather: per tensor, whether any rank's
    elements fail the bf16 check, who holds any, and the ties, summed by one all-reduce; this rank's first tie by
    an exclusive scan over the ranks (ties are laid out rank after rank: the rule's element order). Collective: all
    ranks must call it."""
    local = count_ties_many(engine.master_fragments() if isinstance(engine, MasterFragments) else [])
    failed = [int(n in local and local[n] is None) for n in names]
    present = [int(n in local) for n in names]
    ties = [local.get(n) or 0 for n in names]
    summed = dist.all_reduce_ints(failed + present + ties, "sum", group=group)
    t = len(names)
    ok = [i for i in range(t) if summed[t + i] and not summed[i]]
    census = {names[i]: summed[2 * t + i] for i in ok}
    counted = [i for i in ok if summed[2 * t + i]]
    offsets = dist.exclusive_scan_ints([ties[i] for i in counted], group=group) if counted else []
    me = dist.rank()
    codec = ResidualCodec(census, by_rank={names[i]: ({me: ties[i]} if names[i] in local else {}) for i in ok})
    codec.own_offset = {names[i]: (me, offset) for i, offset in zip(counted, offsets)}
    return codec
