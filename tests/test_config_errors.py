"""A malformed config.json is a one-line named error (exit status 2 from the
CLI), never a traceback; random JSON fed to from_hf_config only ever gives a ModelSpec or a
ConfigError."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, strategies as st

from kvwrite import ModelSpec, cli
from kvwrite.config import ConfigError, MalformedConfig, SpecError, UnknownArchitecture
from kvwrite.config.presets import PRESETS

LLAMA = PRESETS["llama-3.1-8b"][1]

BAD = [
    ([1, 2], MalformedConfig, "must be a JSON object.*got \\[1, 2\\] \\(list\\)"),
    ("not json", None, None),   # a path that does not exist: FileNotFoundError
    ({**LLAMA, "num_hidden_layers": "32"}, MalformedConfig, "'num_hidden_layers' must be an integer, got \"32\""),
    ({**LLAMA, "num_hidden_layers": 32.5}, MalformedConfig, "must be an integer"),
    ({**LLAMA, "num_hidden_layers": True}, MalformedConfig, "must be an integer"),
    ({**LLAMA, "num_attention_heads": 0}, MalformedConfig, "must be >= 1"),
    ({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}, MalformedConfig, "lacks 'num_attention_heads'"),
    ({**LLAMA, "hidden_size": 4097}, MalformedConfig, "hidden_size=4097 is not divisible by num_attention_heads=32"),
    ({**LLAMA, "num_key_value_heads": 7}, MalformedConfig, "must divide num_attention_heads"),
    ({**LLAMA, "torch_dtype": 16}, MalformedConfig, "'torch_dtype' must be a string"),
    ({**LLAMA, "torch_dtype": "int8"}, SpecError, "dtype must be one of"),
    ({**LLAMA, "layer_types": ["full_attention"] * 3}, MalformedConfig, "3 entries for 32 layers"),
    ({**PRESETS["gemma-3-27b"][1], "text_config": [1]}, MalformedConfig, "'text_config' must be a JSON object"),
    ({**PRESETS["qwen3-next-80b-a3b"][1], "linear_conv_kernel_dim": None}, MalformedConfig,
     "lacks 'linear_conv_kernel_dim'"),
    ({"model_type": 3, "architectures": "x"}, UnknownArchitecture, "model_type=3 \\(int\\)"),
]


@pytest.mark.parametrize("cfg, exc, msg", BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_config_is_a_named_one_line_error(cfg, exc, msg):
    if exc is None:
        with pytest.raises(FileNotFoundError):
            ModelSpec.from_hf_config(cfg)
        return
    with pytest.raises(exc, match=msg) as info:
        ModelSpec.from_hf_config(cfg)
    assert "\n" not in str(info.value)


def test_malformed_files_exit_2_from_the_cli(tmp_path, capsys):
    cases = {"list.json": "[1, 2]", "broken.json": '{"model_type": "llama",', "binary.json": b"\xff\xfe\x00",
             "heads.json": json.dumps({**LLAMA, "hidden_size": 4097, "num_attention_heads": 32}),
             "deep.json": "[" * 100000 + "]" * 100000}
    for name, text in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        rc = cli.main(["plan", "--config", str(path), "--max-tokens", "1024"])
        err = capsys.readouterr().err
        assert rc == 2, name
        assert err.startswith("kvwrite plan: MalformedConfig: ") and err.count("\n") == 1, (name, err)
    rc = cli.main(["plan", "--config", str(tmp_path / "missing")])
    assert rc == 2 and "FileNotFoundError" in capsys.readouterr().err


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = sorted({k for _, c in PRESETS.values() for k in c} | {"text_config", "layer_types", "hybrid_override_pattern"})


def _check(cfg) -> None:
    try:
        spec = ModelSpec.from_hf_config(cfg)
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert isinstance(spec, ModelSpec)


@given(JSON)
def test_random_json_never_raises_anything_else(cfg):
    # Any JSON document as a config.json file (a bare str argument would name a path).
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        _check(path)
    if not isinstance(cfg, str):
        _check(cfg)


@given(st.sampled_from(sorted(PRESETS)), st.sampled_from(FIELDS), JSON, st.booleans())
def test_mutated_real_configs_never_raise_anything_else(preset, key, value, drop):
    cfg = json.loads(json.dumps(PRESETS[preset][1]))
    target = cfg["text_config"] if "text_config" in cfg and key != "text_config" and drop else cfg
    if drop:
        target.pop(key, None)
    else:
        target[key] = value
    _check(cfg)
