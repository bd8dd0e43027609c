"""An HF directory's config.json: refused in one ValueError line when it is invalid, of an
architecture this engine does not run, or asks to run its own code (which never runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ragserve.models.hf_config import read_hf_config
from tests.model_factory import tiny_config


def config_dir(tmp_path: Path, **changes: Any) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    config = tiny_config("llama").to_dict()
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_valid_config_is_read(tmp_path: Path) -> None:
    assert read_hf_config(config_dir(tmp_path)).model_type == "llama"


def test_a_config_transformers_refuses_is_one_value_error_line(tmp_path: Path) -> None:
    directory = config_dir(tmp_path, max_position_embeddings=128.0)
    with pytest.raises(ValueError, match=r"invalid config .*max_position_embeddings") as refused:
        read_hf_config(directory)
    assert "\n" not in str(refused.value)


def test_a_directory_that_ships_its_own_code_never_runs_it(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    directory = config_dir(
        tmp_path,
        model_type="internlm2",
        architectures=["InternLM2ForCausalLM"],
        auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"},
    )
    (directory / "configuration_internlm2.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    )
    with pytest.raises(ValueError, match=r"^architecture InternLM2ForCausalLM is not supported"):
        read_hf_config(directory)
    assert not marker.exists()
    # A supported architecture with an auto_map is read with transformers' own class.
    llama = config_dir(tmp_path / "llama", auto_map={"AutoConfig": "configuration_x.X"})
    (llama / "configuration_x.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    )
    assert read_hf_config(llama).model_type == "llama"
    assert not marker.exists()


@pytest.mark.parametrize(
    ("contents", "message"),
    [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")],
)
def test_a_malformed_config_is_named(tmp_path: Path, contents: str, message: str) -> None:
    (tmp_path / "config.json").write_text(contents)
    with pytest.raises(ValueError, match=message):
        read_hf_config(tmp_path)


def test_an_unknown_model_type_is_an_unsupported_architecture(tmp_path: Path) -> None:
    directory = config_dir(tmp_path, model_type="qwen9", architectures=None)
    with pytest.raises(ValueError, match=r"architecture <model_type 'qwen9'> is not supported"):
        read_hf_config(directory)
