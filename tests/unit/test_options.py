"""Options: parsed once into a frozen dataclass; bad words and contradictions fail early with named errors."""

import dataclasses

import pytest
from transformers import HfArgumentParser

from hf_unified_ckpt import UnifiedCheckpointArguments, UnifiedCheckpointOptions, parse_options, with_unified_checkpoint
from hf_unified_ckpt.options import parse_size


def test_defaults_and_frozen():
    opts = parse_options(True, "")
    assert opts == UnifiedCheckpointOptions(enabled=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.enabled = False


def test_unknown_word_names_it_and_lists_valid_words():
    with pytest.raises(ValueError) as e:
        parse_options(True, "async_save,  bogus_word")
    msg = str(e.value)
    assert "bogus_word" in msg and "skip_save_model_weight" in msg and "remove_master_weight" in msg


def test_unknown_word_suggests_the_closest_valid_word():
    with pytest.raises(ValueError) as e:
        parse_options(True, "async_sav, bogus_word")
    assert "'async_sav' (did you mean 'async_save'?)" in str(e.value)
    assert "'bogus_word';" in str(e.value)  # nothing close: no suggestion


@pytest.mark.parametrize("stage,closest", [("01", "O1"), ("2", "O2"), ("O3", None)])
def test_unknown_quant_stage_suggests_the_closest_one(stage, closest):
    with pytest.raises(ValueError) as e:
        parse_options(True, "", ckpt_quant_stage=stage)
    assert (f"(did you mean {closest!r}?)" in str(e.value)) if closest else "did you mean" not in str(e.value)


@pytest.mark.parametrize("config", ["skip_save_model_weight remove_master_weight",
                                    "enable_all_options,remove_master_weight"])
def test_contradiction_is_an_error(config):
    with pytest.raises(ValueError, match="save no weights"):
        parse_options(True, config)


def test_async_save_word():
    assert parse_options(True, "async_save").async_save
    assert parse_options(True, "async_save, enable_all_options") == UnifiedCheckpointOptions(
        enabled=True, async_save=True, skip_save_model_weight=True, master_weight_compatible=True)


def test_master_weight_words():
    assert parse_options(True, "enable_all_options") == UnifiedCheckpointOptions(
        enabled=True, skip_save_model_weight=True, master_weight_compatible=True)
    assert parse_options(True, "remove_master_weight,master_weight_compatible") == UnifiedCheckpointOptions(
        enabled=True, remove_master_weight=True, master_weight_compatible=True)


def test_aggregation_words_and_sizes():
    from hf_unified_ckpt.options import AggregationOptions

    assert parse_options(True, "").aggregation == AggregationOptions("auto", 256 * 2**20, 8, 512 * 2**20)
    opts = parse_options(True, "aggregate", aggregate_range="64MiB", aggregators=4, aggregate_buffer="32MiB")
    assert opts.aggregation == AggregationOptions("always", 64 * 2**20, 4, 32 * 2**20)
    assert opts.aggregation.cell_bytes == 16 * 2**20
    assert parse_options(True, "in_place").aggregation.mode == "never"
    with pytest.raises(ValueError, match="'aggregate'.*'in_place'.*contradict"):
        parse_options(True, "aggregate in_place")
    with pytest.raises(ValueError, match="unified_checkpoint_aggregate_range='big' is not a size"):
        parse_options(True, "", aggregate_range="big")
    with pytest.raises(ValueError, match="unified_checkpoint_aggregators=0"):
        parse_options(True, "", aggregators=0)
    with pytest.raises(ValueError, match="unified_checkpoint_aggregate_buffer='4KiB'.*at least 8KiB"):
        parse_options(True, "", aggregate_buffer="4KiB")


def test_quant_stage_validation():
    with pytest.raises(ValueError, match="O3"):
        parse_options(True, "", ckpt_quant_stage="O3")
    assert parse_options(True, "", ckpt_quant_stage="o1").quant_stage == "O1"
    assert parse_options(True, "", ckpt_quant_stage="O2", disable_ckpt_quant=True).quant_stage == "O0"


@pytest.mark.parametrize("words,named", [("residual_master_weight remove_master_weight", "'remove_master_weight'"),
                                         ("residual_master_weight,skip_save_model_weight", "'skip_save_model_weight'"),
                                         ("enable_all_options residual_master_weight",
                                          "'enable_all_options' (which implies 'skip_save_model_weight')")])
def test_residual_master_weight_contradictions_name_both_words(words, named):
    with pytest.raises(ValueError) as e:
        parse_options(True, words)
    assert "'residual_master_weight'" in str(e.value) and named in str(e.value)
    assert parse_options(True, "residual_master_weight master_weight_compatible").residual_master_weight


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000),
                                           (" 1.5 kb ", 1500), (42, 42)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["5 parsecs", "", "-1", 0])
def test_parse_size_errors(bad):
    with pytest.raises(ValueError, match="unified_checkpoint_max_shard_size"):
        parse_size(bad)


def test_arguments_parse_from_cli_and_yaml(tmp_path):
    parser = HfArgumentParser(UnifiedCheckpointArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--unified_checkpoint", "--unified_checkpoint_max_shard_size", "2MB",
         "--use_cpu"])
    assert args.unified_checkpoint_options == UnifiedCheckpointOptions(enabled=True, max_shard_size=2_000_000)
    yaml_file = tmp_path / "args.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path}\nunified_checkpoint: true\nuse_cpu: true\n")
    (args,) = parser.parse_yaml_file(str(yaml_file))
    assert args.unified_checkpoint_options.enabled and args.unified_checkpoint_options.direct_io
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--unified_checkpoint", "--unified_checkpoint_direct_io", "false"])
    assert args.unified_checkpoint_options == UnifiedCheckpointOptions(enabled=True, direct_io=False)
    helps = {a.dest: a.help for a in parser._actions}
    assert "safetensors" in helps["unified_checkpoint"] and "async_save" in helps["unified_checkpoint_config"]


def test_bad_word_fails_when_arguments_are_built(tmp_path):
    with pytest.raises(ValueError, match="nonsense"):
        UnifiedCheckpointArguments(output_dir=str(tmp_path), unified_checkpoint=True,
                                   unified_checkpoint_config="nonsense", use_cpu=True)


def test_trl_configs_carry_the_fields_and_pickle(tmp_path):
    import pickle

    from trl import DPOConfig, SFTConfig

    from hf_unified_ckpt.trl_configs import UnifiedDPOConfig, UnifiedSFTConfig

    for cls, base in ((UnifiedSFTConfig, SFTConfig), (UnifiedDPOConfig, DPOConfig)):
        cfg = cls(output_dir=str(tmp_path), unified_checkpoint=True, use_cpu=True, bf16=False)
        assert isinstance(cfg, base) and cfg.unified_checkpoint_options.enabled
        assert type(pickle.loads(pickle.dumps(cfg))) is cls
    assert with_unified_checkpoint(SFTConfig) is UnifiedSFTConfig
    with pytest.raises(TypeError, match="TrainingArguments dataclass"):
        with_unified_checkpoint(dict)
