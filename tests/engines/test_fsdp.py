"""Real FSDP (FSDP2 `fully_shard` and FSDP1 FlatParameter) through the Trainer on CPU (gloo), with the test-only
`fsdp_on_cpu` shim; every FSDP run asserts its parameters really are sharded (`support.states.assert_sharded`), so a
silent fallback to DDP fails. Tolerances as in test_resume_equivalence.py (fp32 reduction order: measured
~1e-7, allowed LOSS_RTOL = STATE_ATOL = 1e-5)."""

import pytest
import torch

from support.specs import hop_tag, run_spec, spec_of
from support.states import assert_resumed_matches
from support.faults import record_fault
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
BF16 = {"bf16": True}

SAVERS = {"f2": {"fsdp": 2}, "f1": {"fsdp": 1}, "f2bf16": {"fsdp": 2, "overrides": BF16}}
CELLS = [  # (saved by at 2 ranks, resumed as, world size)
    ("f2", "f2", 2), ("f2bf16", "f2bf16", 2), ("f1", "f2", 2), ("f1", "f1", 2),
    ("f2", "f2", 3), ("f2", "f2", 1), ("f2", "single", 1), ("f2", "z2", 2),
]
KINDS = {"f2": {"fsdp": 2}, "f1": {"fsdp": 1}, "f2bf16": {"fsdp": 2, "overrides": BF16}, "z2": {"zero": 2},
         "z3": {"zero": 3}, "ddp": {}, "single": {}}
# The cross-engine chain: ZeRO-3 x 2 (uninterrupted, saves every 2 steps) -> FSDP2 x 3 from step 2 ->
# DDP x 2 from the FSDP2 run's step 4 -> one process from the DDP run's step 6; each link runs to step 8.
CHAIN = [("z3", 2, None), ("f2", 3, ("chain-z3", 2)), ("ddp", 2, ("chain-f2", 4)), ("single", 1, ("chain-ddp", 6))]
LONG = {"max_steps": 8, "save_steps": 2}


_tag = hop_tag


def _spec(tmp, kind, tag, resume=None, **extra):
    return spec_of(KINDS, tmp, kind, tag, resume, **extra)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    cells = {w: [_spec(tmp, c[1], _tag(c), (c[0], 3)) for c in CELLS if c[2] == w and c[1] != "single"]
             for w in (1, 2, 3)}
    chain = {w: [_spec(tmp, kind, f"chain-{kind}", resume, **LONG) for kind, ww, resume in CHAIN
                 if ww == w and kind != "single"] for w in (2, 3)}
    killed = {**_spec(tmp, "f2", "killed"), "die_mid_write": [1, 6]}
    out = {"killed": torchrun(2, [killed], tmp, expect_failure=True)}
    out["killed-staging"] = sorted(p.name for p in (tmp / "killed").glob(".checkpoint-6.*.incomplete/*.safetensors"))
    out["killed-six"] = detect_layout(tmp / "killed" / "checkpoint-6").kind  # before the resumed run writes it
    resumed = {**_spec(tmp, "f2", "killed-resumed"), "output_dir": str(tmp / "killed"), "resume": True}
    torchrun(2, [_spec(tmp, name, name) for name in SAVERS] + cells[2] + chain[2][:1], tmp)
    torchrun(3, cells[3] + chain[3] + [resumed], tmp)
    torchrun(2, chain[2][1:], tmp)
    torchrun(1, cells[1], tmp)
    for tag in (["killed-resumed"] + list(SAVERS) + [_tag(c) for c in CELLS if c[1] != "single"]
                + [f"chain-{k}" for k, _, _ in CHAIN[:-1]]):
        out[tag] = torch.load(tmp / f"{tag}.pt", weights_only=False)
    for c in CELLS:
        if c[1] == "single":
            out[_tag(c)] = run_spec(_spec(tmp, "single", _tag(c), (c[0], 3)), 1)
    kind, _, resume = CHAIN[-1]
    out["chain-single"] = run_spec(_spec(tmp, kind, "chain-single", resume, **LONG), 1)
    return tmp, out


def _compare(resumed, base, steps, exact):
    assert_resumed_matches(resumed, base, steps, exact, LOSS_RTOL, STATE_ATOL)


@pytest.mark.dist
@pytest.mark.parametrize("cell", CELLS, ids=_tag)
def test_fsdp_resume_matches_uninterrupted(fsdp_runs, cell):
    _, out = fsdp_runs
    saved_by, resumed_as, world = cell
    exact = world == 2 and (saved_by == resumed_as or (saved_by, resumed_as) == ("f1", "f2"))
    _compare(out[_tag(cell)], out[saved_by], (4, 5, 6), exact)


@pytest.mark.dist
def test_rank_killed_in_the_middle_of_a_shared_file_write(fsdp_runs):
    """FSDP2 x 2 writes its shards in place into shared files; rank 1 dies (kill -9) half-way through its ranges
    of the step-6 save. Nothing of step 6 is committed: the partly written file stays in the staging folder only, or
    the survivor, whose agreement on the save's outcome failed at once naming the dead rank, removed that folder
    (issue 58) before the launcher stopped it; `resume_from_checkpoint=True` at 3 ranks picks checkpoint-3 and
    continues as the uninterrupted run."""
    tmp, out = fsdp_runs
    record_fault("rank killed mid shared-file write (FSDP2 x 2)", survived=False)
    said = out["killed"].stdout + out["killed"].stderr
    assert out["killed"].returncode != 0, said[-3000:]
    assert out["killed-staging"] or "could not agree on the save's outcome: a rank died" in said, said[-3000:]
    assert out["killed-six"] == "unknown"  # no checkpoint-6 folder at all
    assert out["killed-resumed"]["global_step"] == 6
    _compare(out["killed-resumed"], out["f2"], (4, 5, 6), exact=False)
    record_fault("rank killed mid shared-file write (FSDP2 x 2)", survived=True)


@pytest.mark.dist
@pytest.mark.parametrize("link", range(1, len(CHAIN)), ids=[f"{k}x{w}" for k, w, _ in CHAIN[1:]])
def test_cross_engine_chain(fsdp_runs, link):
    """ZeRO-3 x 2 -> FSDP2 x 3 -> DDP x 2 -> 1 process: each link matches the uninterrupted ZeRO-3 run."""
    tmp, out = fsdp_runs
    kind, _, (previous, step) = CHAIN[link]
    _compare(out[f"chain-{kind}"], out["chain-z3"], range(step + 1, 9), exact=False)
    saved = detect_layout(tmp / previous / f"checkpoint-{step}")
    assert saved.complete and saved.manifest["saved_by"]["engine"] == {"chain-z3": "deepspeed", "chain-f2": "fsdp",
                                                                      "chain-ddp": "ddp"}[previous]


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SAVERS))
def test_fsdp_checkpoint_loads_with_from_pretrained(fsdp_runs, name):
    from transformers import AutoModelForCausalLM

    from support.models import TokenDataset

    tmp, out = fsdp_runs
    ckpt = tmp / name / "checkpoint-6"
    layout = detect_layout(ckpt)
    assert layout.complete and layout.manifest["saved_by"]["fsdp_version"] == (1 if name == "f1" else 2)
    assert not (ckpt / "pytorch_model_fsdp_0").exists() and not (ckpt / "optimizer_0").exists()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    trained = AutoModelForCausalLM.from_config(loaded.config, dtype=loaded.dtype)
    trained.load_state_dict(out[name]["state"])
    loaded.eval()
    trained.eval()
    with torch.no_grad():
        tokens = TokenDataset(2, seed=3).data
        assert torch.equal(loaded(tokens).logits, trained(tokens).logits)
