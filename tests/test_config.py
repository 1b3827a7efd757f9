"""Configuration: every bad value is refused with a message naming the option."""

import pytest

from mpidl.app.config import Config, ConfigError, parse_config


def test_defaults_are_valid():
    cfg = parse_config([])
    assert cfg.model == "hsicnn" and cfg.batch_size == 64 and cfg.strategy == "flat"
    assert cfg.speed_list is None  # 'auto'


def test_lists_are_parsed():
    cfg = parse_config(["--speeds", "1,2,3,4", "--emulate-slowdown", "1,1,2,4",
                        "--emulate-link", "50,1"], world_size=4)
    assert cfg.speed_list == [1, 2, 3, 4]
    assert cfg.slowdown_list == [1, 1, 2, 4]
    assert cfg.link == (50.0, 1.0)


def test_fault_injection_is_read_from_the_environment_not_the_command_line(monkeypatch):
    """The tests' fault injection (tests/faults.py, run by tests/faulty_train.py): not a
    product module, not an option of the command line."""
    import importlib.util

    from faults import ENV, Fault, fault_from_environment, parse_fault
    assert importlib.util.find_spec("mpidl.faults") is None
    assert parse_fault("1:5", 4) == Fault(1, 5, "raise") and parse_fault("0:2:nan", 1) == Fault(0, 2, "nan")
    assert Fault(1, 5).at(1, 5) == "raise" and Fault(1, 5).at(0, 5) is None
    for text, message in (("x", "is RANK:STEP"), ("5:1", r"rank must be in \[0, 2\)"), ("1:1:boom", "is RANK:STEP")):
        with pytest.raises(ValueError, match=message):
            parse_fault(text, 2)
    monkeypatch.delenv(ENV, raising=False)
    assert fault_from_environment(2) is None
    monkeypatch.setenv(ENV, "1:3:term")
    assert fault_from_environment(2) == Fault(1, 3, "term")
    with pytest.raises(ConfigError, match="unrecognized arguments: --inject-fault"):
        parse_config(["--inject-fault", "1:5"], world_size=2)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--model", "vgg99"], 1, "--model 'vgg99' is not one of"),
        (["--batch-size", "0"], 1, "--batch-size must be a positive integer"),
        (["--batch-size", "-3"], 1, "--batch-size must be a positive integer"),
        (["--epochs", "0"], 1, "--epochs must be a positive integer"),
        (["--speeds", "1,2,3"], 4, "--speeds: 3 entries in '1,2,3' but there are 4 ranks"),
        (["--speeds", "1,0,1,1"], 4, "--speeds: entry 1 ('0') must be a finite number > 0"),
        (["--speeds", "1,x,1,1"], 4, "--speeds: entry 1 ('x') is not a number"),
        (["--sync-every", "0"], 1, "--sync-every: must be an integer >= 1 or 'epoch', got '0'"),
        (["--sync-every", "x"], 1, "--sync-every: must be an integer >= 1 or 'epoch', got 'x'"),
        (["--sync-every", "1.5"], 1, "--sync-every: must be an integer >= 1 or 'epoch', got '1.5'"),
        (["--sync-every", "-2"], 1, "--sync-every: must be an integer >= 1 or 'epoch', got '-2'"),
        (["--sync-every", "Epochs"], 1, "--sync-every: must be an integer >= 1 or 'epoch', got 'Epochs'"),
        (["--strategy", "ring"], 1, "--strategy: unknown strategy 'ring'"),
        (["--weighting", "weird"], 1, "--weighting"),
        (["--lr", "0"], 1, "--lr must be a positive number"),
        (["--momentum", "1.5"], 1, "--momentum must be in [0, 1)"),
        (["--nesterov", "--momentum", "0"], 1, "--nesterov needs --momentum > 0"),
        (["--nesterov", "--optimizer", "adam"], 1, "--nesterov applies to --optimizer sgd only"),
        (["--emulate-slowdown", "1,0.5"], 2, "must be >= 1"),
        (["--emulate-link", "50"], 1, "--emulate-link: expected 'LATENCY_US,GBIT_S'"),
        (["--emulate-link", "50,0"], 1, "--emulate-link: link gbit_s must be a finite number > 0"),
        (["--resume"], 1, "--resume needs --checkpoint"),
        (["--balance", "none", "--rebalance"], 2, "--balance none keeps the equal split"),
        (["--emulate-clock", "cpu"], 2, "give --emulate-slowdown too"),
        (["--cache"], 1, "the built-in scene is in memory already"),
        (["--data", "/nonexistent/file.h5"], 1, "--data /nonexistent/file.h5: no such file"),
        (["--dtype", "float16"], 1, "--dtype 'float16' is not one of"),
        (["--on-nan", "ignore"], 1, "--on-nan"),
        (["--model-args", "[1, 2]"], 1, "--model-args must be a JSON object"),
        (["--model-args", "{patch: 1}"], 1, "--model-args must be a JSON object"),
    ],
)
def test_bad_values_are_refused(argv, world, message):
    with pytest.raises(ConfigError) as info:
        parse_config(argv, world_size=world)
    assert message in str(info.value)


def test_model_args_are_parsed():
    cfg = parse_config(["--model", "vit", "--model-args", '{"patch": 1, "depth": 3}'])
    assert cfg.model_kwargs == {"patch": 1, "depth": 3}
    assert parse_config([]).model_kwargs == {}
    assert "model_kwargs" not in cfg.to_dict() and cfg.to_dict()["model_args"] == '{"patch": 1, "depth": 3}'


def test_to_dict_is_plain():
    d = Config().validate().to_dict()
    assert "speed_list" not in d and d["model"] == "hsicnn"


def test_allowed_names_come_from_the_registries_that_own_them(monkeypatch):
    """A model, optimizer or schedule registered in its own module is accepted with no edit
    of the configuration module."""
    import mpidl.engine.models as models
    import mpidl.engine.optim as optim

    monkeypatch.setitem(models.MODELS, "toy", models.MODELS["hsicnn"])
    monkeypatch.setitem(optim.OPTIMIZERS, "toyopt", optim.SGD)
    cfg = parse_config(["--model", "toy", "--optimizer", "toyopt"])
    assert (cfg.model, cfg.optimizer) == ("toy", "toyopt")
    with pytest.raises(ConfigError, match="--model 'resnet9' is not one of: .*toy"):
        parse_config(["--model", "resnet9"])


def test_negative_numbers_in_list_options_parse():
    with pytest.raises(ConfigError, match=r"--speeds: entry 0 \('-1'\) must be a finite number > 0"):
        parse_config(["--speeds", "-1,1,1,1"], world_size=4)
    with pytest.raises(ConfigError, match="--emulate-slowdown"):
        parse_config(["--emulate-slowdown", "-2,1"], world_size=2)
    assert parse_config(["--lr", "1e-3"]).lr == 1e-3


def test_argparse_errors_are_config_errors():
    """The command line agrees on them like any set-up error: one line, rank 0, exit 2."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --nope"):
        parse_config(["--nope"])
    with pytest.raises(ConfigError, match="argument --epochs: invalid int value: 'x'"):
        parse_config(["--epochs", "x"])


def test_a_directory_as_data_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"--data {tmp_path}: is a directory"):
        parse_config(["--data", str(tmp_path)])


@pytest.mark.parametrize("text, expected", [("epoch", "epoch"), ("1", 1), ("37", 37)])
def test_sync_every_takes_an_integer_or_epoch(text, expected):
    cfg = parse_config(["--strategy", "node", "--sync-every", text])
    assert cfg.sync_every == expected and type(cfg.sync_every) is type(expected)
    assert parse_config([]).sync_every == 50  # the default, an int


def test_sync_every_epoch_is_in_the_help():
    from mpidl.app.config import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "--sync-every K K': steps between inter-node syncs (node strategy): an integer >= 1, or 'epoch'" in help_text


def test_every_option_has_a_help_text_with_its_default():
    from mpidl.app.config import build_parser

    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        name = action.option_strings[-1]
        assert action.help, f"{name} has no help text"
        shown = parser._get_formatter()._expand_help(action) if action.help else ""
        assert "default" in shown, f"{name}: no default in {shown!r}"
        assert shown.count("(default") <= 1, f"{name}: the default twice in {shown!r}"
    assert text.count("(default: None)") == 0
