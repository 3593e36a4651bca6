"""What users run, under every engine (DDP, DeepSpeed ZeRO-1/2/3, FSDP2, FSDP1; real processes, gloo):

- a tied-embedding model (GPT-2: `lm_head.weight` is `transformer.wte.weight`, as in Llama-3.2, Qwen2.5, Gemma):
  save, resume at the same world size (exact) and at another (tolerance), across engines, `from_pretrained`;
- `load_best_model_at_end` with rotation: the final weights are the best checkpoint's;
- `trainer.save_model(dir)` after training: `from_pretrained(dir)` gives the trained weights (ZeRO-3 without
  `stage3_gather_16bit_weights_on_model_save`, FSDP with sharded state dicts);
- what unified checkpoints refuse is refused in `train()` before the first step.

All runs of one world size share one launch. Tolerance when the world size changes: fp32 reduction order, as in
test_resume_equivalence.py (measured ~1e-7, allowed LOSS_RTOL = STATE_ATOL = 1e-5).
"""

import pytest
import torch

from support.models import TokenDataset
from support.specs import BEST, run_spec
from support.states import assert_resumed_matches
from support.launches import torchrun
from hf_unified_ckpt.checkpoint.folder.layout import detect_layout

LOSS_RTOL = STATE_ATOL = 1e-5
ENGINES = {"ddp": {}, "z1": {"zero": 1}, "z2": {"zero": 2}, "z3": {"zero": 3}, "f2": {"fsdp": 2}, "f1": {"fsdp": 1}}
ANY_SIZE = {"single": {}}
#: `load_best_model_at_end` with rotation and a tied model; DDP, ZeRO-3 and FSDP2 are compared with the native Trainer,
#: best first, middle and last, in test_native_parity.py.
BEST_ENGINES = ["z1", "z2", "f1"]
# (saved by at 2 ranks, resumed as, world size): every engine at 2 and 3 ranks, and across engines.
CELLS = ([(e, e, w) for e in ENGINES for w in (2, 3)]
         + [("z3", "f2", 3), ("f2", "z3", 2), ("z2", "f1", 2), ("f2", "single", 1), ("z3", "single", 1)])
REFUSED = {  # run -> what the error says; each must stop before step 1
    "lora-f1": ({"fsdp": 1, "model": "lora"}, "PEFT/LoRA models under FSDP1 are not supported"),
}


def _tag(cell):
    return f"{cell[0]}-to-{cell[1]}-at{cell[2]}"


def _spec(tmp, kind, tag, resume=None, **extra):
    spec = {**{**ENGINES, **ANY_SIZE}[kind], "model": "gpt2"}
    spec.update(extra, output_dir=str(tmp / tag), result=str(tmp / f"{tag}.pt"))
    if resume:
        spec["resume"] = str(tmp / resume / "checkpoint-3")
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("every-engine")
    savers = [_spec(tmp, e, e, save_model=str(tmp / f"{e}-model")) for e in ENGINES]
    best = [_spec(tmp, e, f"best-{e}", eval=True, overrides=dict(BEST)) for e in BEST_ENGINES]
    refused = [{**spec, "output_dir": str(tmp / name), "result": str(tmp / f"{name}.pt"), "expect_error": text,
                "overrides": {**spec.get("overrides", {}), "save_steps": 1}} for name, (spec, text) in REFUSED.items()]
    cells = {w: [_spec(tmp, c[1], _tag(c), c[0]) for c in CELLS if c[2] == w and c[1] != "single"] for w in (2, 3)}
    as_ddp = _spec(tmp, "f2", "fsdp-as-ddp", fsdp_shim=False)  # FSDP asked for; accelerate runs DDP on CPU
    launch = torchrun(2, savers + cells[2] + best + refused + [as_ddp], tmp)
    torchrun(3, cells[3], tmp)
    names = list(ENGINES) + [f"best-{e}" for e in BEST_ENGINES] + list(REFUSED) + [_tag(c) for c in CELLS if c[2] > 1]
    out = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in names}
    out["launch-2"] = launch.stdout + launch.stderr
    for c in CELLS:
        if c[1] == "single":
            out[_tag(c)] = run_spec(_spec(tmp, "single", _tag(c), c[0]), 1)
    return tmp, out


@pytest.mark.dist
@pytest.mark.parametrize("cell", CELLS, ids=_tag)
def test_tied_model_resumes_on_every_engine(runs, cell):
    tmp, out = runs
    saved_by, resumed_as, world = cell
    assert_resumed_matches(out[_tag(cell)], out[saved_by], (4, 5, 6), saved_by == resumed_as and world == 2,
                           LOSS_RTOL, STATE_ATOL)
    assert detect_layout(tmp / _tag(cell) / "checkpoint-6").complete
    assert _model_keys(tmp / saved_by / "checkpoint-6") == {k for k in out[saved_by]["state"] if k != "lm_head.weight"}


def _model_keys(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        return set(f.keys())


def _pretrained_state(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading
    return model, model.state_dict()


def _assert_same_weights(got: dict, want: dict) -> None:
    assert set(want) <= set(got)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.dist
@pytest.mark.parametrize("engine", list(ENGINES))
def test_tied_checkpoint_loads_with_from_pretrained(runs, engine):
    tmp, out = runs
    model, state = _pretrained_state(tmp / engine / "checkpoint-6")
    _assert_same_weights(state, out[engine]["state"])
    with torch.no_grad():
        model.eval()
        assert torch.isfinite(model(TokenDataset(2, seed=3).data).logits).all()


@pytest.mark.dist
@pytest.mark.parametrize("engine", list(ENGINES))
def test_save_model_writes_what_from_pretrained_loads(runs, engine):
    """`trainer.save_model(dir)` (ZeRO-3 without the gather flag, FSDP sharded state dicts included)."""
    tmp, out = runs
    folder = tmp / f"{engine}-model"
    assert not list(folder.glob("global_step*")) and not (folder / "pytorch_model_fsdp_0").exists()
    _, state = _pretrained_state(folder)
    _assert_same_weights(state, out[engine]["state"])
    assert (folder / "training_args.bin").is_file() and (folder / "config.json").is_file()


@pytest.mark.dist
@pytest.mark.parametrize("engine", BEST_ENGINES)
def test_load_best_model_at_end_loads_the_best_checkpoint(runs, engine):
    tmp, out = runs
    result = out[f"best-{engine}"]
    best = result["best"]
    assert best is not None and not best.endswith("checkpoint-6"), best  # an earlier checkpoint, kept by rotation
    assert best.endswith(f"checkpoint-{result['best_global_step']}"), (best, result["best_global_step"])
    kept = sorted(p.name for p in (tmp / f"best-{engine}").glob("checkpoint-*"))
    assert kept == sorted({"checkpoint-6", best.rsplit("/", 1)[-1]}), kept
    _, state = _pretrained_state(best)
    _assert_same_weights(result["state"], state)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_runs_are_refused_before_the_first_step(runs, name):
    tmp, out = runs
    assert out[name]["global_step"] == 0, out[name]
    assert out[name]["error"].startswith("UnsupportedCheckpointError: ")
    assert not list((tmp / name).glob("*checkpoint-*"))


@pytest.mark.dist
def test_fsdp_replaced_by_ddp_is_said_once(runs):
    """accelerate silently trains with DDP when FSDP is asked for on CPU; the plugin knows both and says so once
    (rank 0), in the one run of the launch that asked for FSDP without the test shim."""
    _, out = runs
    assert out["launch-2"].count("FSDP was requested") == 1
    assert "but the model is trained with DDP" in out["launch-2"]
