"""Typed run configuration (agonlib/config.py): profiles, cells, overrides and the errors people see."""

import json

import pytest
import yaml

from agonlib import Config, ConfigError, load_config
from agonlib.config import CELLS_FILE, available_cells, available_profiles, parse_override

PROFILES = ["cpu", "smoke", "colab", "paper"]


# --- profiles and cells --------------------------------------------------------------------


def test_the_four_profiles_exist():
    assert sorted(available_profiles()) == sorted(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_loads(profile):
    cfg = load_config(profile)
    assert isinstance(cfg, Config)
    assert cfg.profile == profile
    assert cfg.run_name == "agon"
    assert cfg.run_dir.parts[-2:] == (profile, "agon")


@pytest.mark.parametrize(
    "profile,model,thinking,dataset",
    [
        # the main job: SmolLM2 GGUF on synthetic problems, no thinking
        ("cpu", "smollm2-135m-instruct", False, "synthetic"),
        # CI wiring: the tiny random Qwen3
        ("smoke", "tiny-qwen3", False, "synthetic"),
        # the GPU profiles: Qwen3-0.6B thinking on DeepMath-hard
        ("colab", "Qwen/Qwen3-0.6B", True, "deepmath"),
        ("paper", "Qwen/Qwen3-0.6B", True, "deepmath"),
    ],
)
def test_profiles_match_the_design(profile, model, thinking, dataset):
    cfg = load_config(profile)
    assert (cfg.model, cfg.thinking, cfg.dataset) == (model, thinking, dataset)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("cell", sorted(available_cells()))
def test_every_cell_applies_to_every_profile(profile, cell):
    cfg = load_config(profile, cell=cell)
    assert cfg.run_name == cell
    for key, value in available_cells()[cell].items():
        assert getattr(cfg, key) == value


@pytest.mark.parametrize(
    "cell,expected",
    [
        # the 2x2 and fixed roles: (mode, reward, exchange, roles)
        ("agon", ("agon", "competitive", True, "rotate")),
        ("coop_exchange", ("agon", "cooperative", True, "rotate")),
        ("comp_no_exchange", ("agon", "competitive", False, "rotate")),
        ("coop_no_exchange", ("agon", "cooperative", False, "rotate")),
        ("fixed_roles", ("agon", "competitive", True, "fixed")),
    ],
)
def test_cells_are_the_design_table(cell, expected):
    cfg = load_config("cpu", cell=cell)
    assert (cfg.mode, cfg.reward, cfg.exchange, cfg.roles) == expected


def test_fixed_roles_cell():
    cfg = load_config("cpu", cell="fixed_roles")
    assert cfg.roles == "fixed"
    assert cfg.run_name == "fixed_roles"
    assert cfg.run_dir.parts[-2:] == ("cpu", "fixed_roles")


def test_overrides_beat_the_cell():
    assert load_config("smoke", cell="fixed_roles", roles="rotate").roles == "rotate"


@pytest.mark.parametrize(
    "cell,num_generations,expected",
    [
        # Agon and plain GRPO draft N per problem
        ("agon", 4, 4),
        ("grpo", 4, 4),
        # compute-matched vanilla GRPO drafts 2N
        ("grpo_2n", 4, 8),
        ("grpo_2n", 2, 4),
    ],
)
def test_generations_per_problem(cell, num_generations, expected):
    cfg = load_config("smoke", cell=cell, num_generations=num_generations)
    assert cfg.generations_per_problem == expected


def test_compute_matched_flag_only_counts_in_grpo_mode():
    assert load_config("smoke", cell="agon", grpo_compute_matched=True).generations_per_problem == 2


def test_unknown_cell_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"fixed_role.*Did you mean 'fixed_roles'"):
        load_config("cpu", cell="fixed_role")


# --- overrides -----------------------------------------------------------------------------


def test_flat_overrides():
    cfg = load_config("smoke", steps=4, seed=1, out_dir="/tmp/r")
    assert (cfg.steps, cfg.seed, cfg.out_dir) == (4, 1, "/tmp/r")
    assert str(cfg.run_dir) == "/tmp/r"
    assert cfg.profile == "smoke" and cfg.model == "tiny-qwen3"  # the rest is the profile's


@pytest.mark.parametrize(
    "key,value",
    [
        # every key DESIGN.md §7 promises as a flat override
        ("steps", 3), ("seed", 7), ("out_dir", "/tmp/x"), ("mode", "grpo"), ("reward", "cooperative"),
        ("exchange", False), ("roles", "fixed"), ("lambda_conv", 0.5), ("lambda_len", 0.1),
        ("num_generations", 3), ("problems_per_step", 5), ("max_new_tokens", 64),
        ("checkpoint_every", 2), ("eval_every", 3), ("resume", True),
    ],
)
def test_design_override_keys(key, value):
    assert getattr(load_config("smoke", **{key: value}), key) == value


def test_int_for_float_is_converted():
    cfg = load_config("smoke", lambda_conv=2)
    assert cfg.lambda_conv == 2.0 and isinstance(cfg.lambda_conv, float)


def test_replace_validates():
    cfg = load_config("smoke")
    assert cfg.replace(steps=9).steps == 9
    assert cfg.steps == 2  # the original is untouched
    with pytest.raises(ConfigError, match="Did you mean 'steps'"):
        cfg.replace(stepz=9)


@pytest.mark.parametrize(
    "text,expected",
    [
        # ints, floats, bools, lists, strings and paths are read as YAML scalars
        ("steps=4", ("steps", 4)),
        ("lambda_conv=0.5", ("lambda_conv", 0.5)),
        ("exchange=false", ("exchange", False)),
        ("levels=[1, 2]", ("levels", [1, 2])),
        ("roles=fixed", ("roles", "fixed")),
        ("out_dir=/tmp/x", ("out_dir", "/tmp/x")),
        # spaces around the key are trimmed; the first '=' splits
        (" seed = 3", ("seed", 3)),
        ("model=a=b", ("model", "a=b")),
        # an empty value is the empty string, not None
        ("model=", ("model", "")),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_parse_override_needs_an_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("steps")


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,nearest",
    [
        # a typo names the key and the nearest valid one
        ("lamda_conv", "lambda_conv"),
        ("num_generation", "num_generations"),
        ("stepz", "steps"),
        ("lora_rank", "lora_r"),
    ],
)
def test_unknown_key_names_the_nearest(key, nearest):
    with pytest.raises(ConfigError) as err:
        load_config("smoke", **{key: 1})
    assert repr(key) in str(err.value)
    assert f"Did you mean {nearest!r}?" in str(err.value)


def test_unknown_key_without_a_near_one():
    with pytest.raises(ConfigError, match="Unknown config key 'zzzzzz'") as err:
        load_config("smoke", zzzzzz=1)
    assert "Did you mean" not in str(err.value)


BAD_VALUES = [
    # (overrides, words the message must contain)
    # a typo in a choice lists the choices
    ({"mode": "agn"}, ["mode='agn'", "agon, grpo"]),
    ({"roles": "rotating"}, ["roles='rotating'", "rotate, fixed"]),
    ({"reward": "comp"}, ["competitive, cooperative"]),
    ({"loss_type": "ppo"}, ["grpo, bnpo, dr_grpo, dapo"]),
    ({"summary_mask": "numbers"}, ["summary_mask='numbers'", "answer, derived"]),
    # epsilon must be a clip range in (0, 1)
    ({"epsilon": 2}, ["epsilon", "(0, 1)"]),
    ({"epsilon": 0}, ["epsilon", "(0, 1)"]),
    # GRPO needs a group
    ({"num_generations": 1}, ["num_generations=1", "at least 2"]),
    # wrong types, including YAML strings and bools where numbers belong
    ({"steps": "3"}, ["steps='3'", "int"]),
    ({"steps": 3.5}, ["steps=3.5", "int"]),
    ({"steps": True}, ["steps=True", "int"]),
    ({"exchange": "yes"}, ["exchange='yes'", "bool"]),
    ({"levels": 1}, ["levels=1", "list"]),
    ({"lambda_conv": "1"}, ["lambda_conv='1'", "float"]),
    # counts must be positive
    ({"steps": 0}, ["steps must be at least 1"]),
    ({"max_new_tokens": -5}, ["max_new_tokens"]),
    # greedy decoding breaks GRPO
    ({"temperature": 0.0}, ["temperature must be > 0"]),
    ({"top_p": 0.0}, ["top_p"]),
    ({"top_p": 1.5}, ["top_p"]),
    # negative weights
    ({"lambda_conv": -1.0}, [">= 0"]),
    ({"beta": -0.1}, [">= 0"]),
    # pass@k needs k samples
    ({"pass_k": [1, 4]}, ["eval_samples >= 4"]),
    # code tasks need a code dataset
    ({"task": "code"}, ["code_handwritten or codecontests"]),
    # the derived-number mask is for math summaries
    ({"summary_mask": "derived", "task": "code", "dataset": "code_handwritten"}, ["summary_mask='derived'", "task=math"]),
]


@pytest.mark.parametrize("overrides,words", BAD_VALUES, ids=[",".join(f"{k}={v!r}" for k, v in o.items()) for o, _ in BAD_VALUES])
def test_bad_values_say_how_to_fix_them(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("smoke", **overrides)
    message = str(err.value)
    for word in words:
        assert word in message
    assert "\n" not in message  # one sentence, no traceback dump


UNCHECKED = [
    # Values the dataclass accepts today that fail later, deep inside torch/peft/the
    # tokenizer (STYLE 12: a bad config value gets one clear sentence, not a traceback).
    # top_k=-1: torch.topk(..., -1) raises "selected index k out of range" mid-rollout
    {"top_k": -1},
    # lora_dropout=1.5: torch.nn.Dropout raises at model load
    {"lora_dropout": 1.5},
    # max_prompt_tokens=0: every prompt is truncated to nothing
    {"max_prompt_tokens": 0},
    # a negative upper clip: clamp(ρ, 1-ε, 1+ε_high) with 1+ε_high < 1 inverts the clip
    {"epsilon_high": -0.5},
    # lora_targets must be "all-linear" or a list of module names
    {"lora_targets": 5},
]


@pytest.mark.parametrize("overrides", UNCHECKED, ids=[next(iter(o)) for o in UNCHECKED])
def test_values_that_fail_later_are_rejected_up_front(overrides):
    with pytest.raises(ConfigError, match=next(iter(overrides))):
        load_config("smoke", **overrides)


def test_unknown_profile_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"No profile 'smok'.*Did you mean 'smoke'\?"):
        load_config("smok")


def test_unknown_profile_far_from_all_lists_them():
    with pytest.raises(ConfigError, match="Available: colab, cpu, paper, smoke"):
        load_config("nothing_like_it")


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/run.yaml")


# --- YAML files ----------------------------------------------------------------------------


def test_yaml_file_inherits_its_profile(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("profile: smoke\nsteps: 3\nroles: fixed\n")
    cfg = load_config(str(path))
    assert cfg.profile == "smoke"
    assert cfg.model == "tiny-qwen3"  # from the smoke profile
    assert (cfg.steps, cfg.roles) == (3, "fixed")  # from the file


def test_yaml_file_then_cell_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("profile: smoke\nsteps: 3\nroles: fixed\n")
    cfg = load_config(path, cell="grpo_2n", steps=5)
    assert (cfg.steps, cfg.mode, cfg.generations_per_problem, cfg.run_name) == (5, "grpo", 4, "grpo_2n")


def test_yaml_file_without_profile_uses_cpu(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\n")
    cfg = load_config(str(path))
    assert (cfg.profile, cfg.model, cfg.steps) == ("cpu", "smollm2-135m-instruct", 3)


@pytest.mark.parametrize(
    "body,words",
    [
        # a typo in a file names the file and the nearest key
        ("profile: smoke\nlamda_conv: 1\n", ["lamda_conv", "run.yaml", "lambda_conv"]),
        # a bad value in a file is a ConfigError too
        ("profile: smoke\nmode: agn\n", ["mode='agn'"]),
        # a file naming an unknown profile
        ("profile: smok\n", ["Did you mean 'smoke'"]),
        # not a mapping
        ("- steps\n- 3\n", ["must hold a mapping"]),
        # not YAML at all
        ("steps: [1, 2\n", ["not valid YAML"]),
    ],
)
def test_bad_yaml_files(tmp_path, body, words):
    path = tmp_path / "run.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    for word in words:
        assert word in str(err.value)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("smoke", cell="fixed_roles", steps=3)
    cfg.save(tmp_path / "config.json")
    again = Config(**json.loads((tmp_path / "config.json").read_text()))
    assert again == cfg


def test_cells_file_only_uses_known_keys():
    cells = yaml.safe_load(CELLS_FILE.read_text())
    known = set(Config.__dataclass_fields__)
    for name, overrides in cells.items():
        assert set(overrides) <= known, name


# --- renamed keys (issue 13): one name per choice ------------------------------------------


RENAMES = [
    # (old key, new key, a value both accept)
    ("backend", "model_loader", "transformers"),  # how the base model is loaded
    ("generation_backend", "generation_engine", "transformers"),  # what samples the rollouts
    ("decoder", "decode_forward", "fast"),  # the forward pass agonlib's decode loop runs
]


@pytest.mark.parametrize("old,new,value", RENAMES)
def test_old_keys_are_refused_with_the_new_name(old, new, value, tmp_path):
    assert getattr(load_config("smoke", **{new: value}), new) == value
    with pytest.raises(ConfigError, match=f"'{old}' in overrides is now '{new}'"):
        load_config("smoke", **{old: value})  # an override, as --set passes it
    with pytest.raises(ConfigError, match=f"is now '{new}'"):
        load_config("smoke").replace(**{old: value})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"profile": "smoke", old: value}))
    with pytest.raises(ConfigError, match=f"'{old}' in {path} is now '{new}'"):
        load_config(str(path))


@pytest.mark.parametrize("old,new,value", RENAMES)
def test_the_cli_and_reproduce_refuse_old_keys(old, new, value, capsys):
    from agonlib.__main__ import main
    from agonlib.study.reproduce import resolve_parameters

    assert main(["train", "smoke", "--set", f"{old}={value}"]) != 0
    assert f"is now '{new}'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"'{old}' in --set is now '{new}'"):
        resolve_parameters([], "smoke", settings={old: value})


def test_run_records_with_old_keys_still_load(tmp_path):
    from agonlib.runs import load_run_config, recorded_config

    values = load_config("smoke", out_dir=str(tmp_path)).to_dict()
    for old, new, value in RENAMES:  # a config.json written before the renames
        del values[new]
        values[old] = value
    (tmp_path / "config.json").write_text(json.dumps({"config": values}))
    cfg = load_run_config(tmp_path)
    assert (cfg.model_loader, cfg.generation_engine, cfg.decode_forward) == ("transformers", "transformers", "fast")
    assert recorded_config(tmp_path)["decode_forward"] == "fast"


def test_eval_of_a_run_directory_refuses_settings_it_would_ignore(tmp_path):
    from agonlib.__main__ import main

    with pytest.raises(SystemExit, match="evaluated with the config it was trained with"):
        main(["eval", str(tmp_path), "--set", "summary_mask=derived"])


def test_engines_are_sized_for_the_longer_of_the_two_roles():
    # a challenger allowed more tokens than the drafter: the engine must hold its sequences too
    longer = load_config("smoke", max_prompt_tokens=100, max_new_tokens=20, challenger_max_new_tokens=50)
    assert (longer.challenger_tokens, longer.max_sequence_tokens) == (50, 150)
    shorter = longer.replace(challenger_max_new_tokens=10)
    assert (shorter.challenger_tokens, shorter.max_sequence_tokens) == (10, 120)
    assert longer.replace(challenger_max_new_tokens=None).max_sequence_tokens == 120
