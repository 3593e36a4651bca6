"""DeepSpeed fp16 with dynamic loss scaling (real DeepSpeed, 2 and 3 processes, gloo): the loss scaler's state
(scale, iteration, last overflow, hysteresis) and the engine's skipped-step count are saved and restored exactly,
so a resumed run skips the same steps and matches the uninterrupted one.

The scaler is set to move in a few steps (initial scale 2^18, window 2, hysteresis 2: measured here, steps 4, 6
and 10 overflow and are skipped, the scale doubles and halves), and the test checks that it did move before the
save, so a resume that restarted the scaler would skip other steps and fail.

DeepSpeed's CPU accelerator reports fp16 as unsupported on CPUs without AVX512-FP16/AMX-FP16 (this one); the test
worker lifts that check (`support.env.fp16_on_cpu`, test-only) so the fp16 code path runs as it does on a GPU.
"""

import pytest
import torch

from support.states import assert_resumed_matches
from support.launches import torchrun

MAX_STEPS, SAVE_STEPS = 10, 2
SAVED_AT = 4  # after the first overflow: scale 2^19, last overflow at iteration 3, hysteresis 1
# Another ZeRO stage at the same world size: the same fp16 gradients and reductions here (measured equal).
LOSS_RTOL, STATE_ATOL = 1e-6, 1e-6
# Another world size: the reduction order changes the fp16 gradients' last bits, and a step that overflowed at 2
# ranks may not at 3 (one update more or less: measured 2.6e-3 relative on the loss after it).
WORLD_LOSS_RTOL = 1e-2
FP16 = {"fp16": True, "max_steps": MAX_STEPS, "save_steps": SAVE_STEPS}


def _spec(tmp, tag, zero, resume=None):
    spec = {"zero": zero, "fp16": True, "model": "llama", "output_dir": str(tmp / tag),
            "result": str(tmp / f"{tag}.pt"), "overrides": dict(FP16)}
    if resume:
        spec["resume"] = str(tmp / resume / f"checkpoint-{SAVED_AT}")
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    two = [_spec(tmp, "z2", 2), _spec(tmp, "z2-same", 2, "z2"), _spec(tmp, "z2-z3", 3, "z2"),
           _spec(tmp, "z2-fresh-scaler", 2, "z2")]
    two[-1]["forget_loss_scaler"] = True  # what a resume without the scaler state would do
    torchrun(2, two, tmp)
    torchrun(3, [_spec(tmp, "z2-z1x3", 1, "z2")], tmp)
    out = {s["output_dir"].rsplit("/", 1)[1]: torch.load(s["result"], weights_only=False) for s in two}
    out["z2-z1x3"] = torch.load(tmp / "z2-z1x3.pt", weights_only=False)
    return tmp, out


@pytest.mark.dist
def test_the_loss_scale_moved_and_steps_were_skipped(runs):
    _, out = runs
    scaler = out["z2"]["loss_scaler"]
    assert scaler["skipped_steps"] >= 2 and scaler["last_overflow_iter"] > SAVED_AT, scaler
    at_save = out["z2-same"]["scaler_at_start"]
    assert at_save["cur_scale"] != 2 ** 18 and at_save["last_overflow_iter"] >= 0, at_save


@pytest.mark.dist
@pytest.mark.parametrize("tag,exact", [("z2-same", True), ("z2-z3", False)])
def test_fp16_resume_restores_the_loss_scaler(runs, tag, exact):
    """Same world size (same or another ZeRO stage): the resumed run starts with the saved scaler, skips the same
    steps and ends with the same scaler, losses and weights."""
    _, out = runs
    assert out[tag]["scaler_at_start"] == out["z2"]["scaler_at"][SAVED_AT]
    assert out[tag]["loss_scaler"] == out["z2"]["loss_scaler"]
    assert_resumed_matches(out[tag], out["z2"], range(SAVED_AT + 1, MAX_STEPS + 1), exact, LOSS_RTOL, STATE_ATOL)


@pytest.mark.dist
def test_fp16_resume_at_another_world_size_starts_from_the_saved_scaler(runs):
    """3 processes: the saved scaler is restored; the fp16 gradients then differ in their last bits (reduction
    order), so a later overflow may fall on another step: the loss curve stays within the fp16 tolerance."""
    _, out = runs
    assert out["z2-z1x3"]["scaler_at_start"] == out["z2"]["scaler_at"][SAVED_AT]
    for step in range(SAVED_AT + 1, MAX_STEPS + 1):
        a, b = out["z2-z1x3"]["losses"][step], out["z2"]["losses"][step]
        assert abs(a - b) <= WORLD_LOSS_RTOL * abs(b), (step, a, b)


@pytest.mark.dist
def test_a_restarted_scaler_would_skip_other_steps(runs):
    """The control: the same resume with the scaler reset to its initial state diverges from the uninterrupted run,
    so the test above can fail."""
    _, out = runs
    assert out["z2-fresh-scaler"]["loss_scaler"] != out["z2"]["loss_scaler"]
