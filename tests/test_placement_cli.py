"""`ln-lightning inspect MODULE:FACTORY` and `ln-lightning demo`."""

from __future__ import annotations

import json

import pytest
from torch import nn

from ln_lightning.cli import main


def build_encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_inspect_prints_tables_and_what_convert_would_change(capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parent.parent)
    assert main(["inspect", "tests.test_placement_cli:build_encoder", "--placement", "pre"]) == 0
    out = capsys.readouterr().out
    assert "stack layers: 2 blocks, final norm: none" in out
    assert "layers.0  converted  post -> pre" in out
    assert "the model was not modified" in out


def test_inspect_json(capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parent.parent)
    assert main(["inspect", "tests.test_placement_cli:build_encoder", "--json", "--placement", "pre"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["placement"] for b in data["inspect"]["stacks"][0]["blocks"]] == ["post", "post"]  # unchanged
    assert data["convert"]["added"] == ["norm"] and data["convert"]["changed"]


def test_inspect_bad_factory_says_what_it_expects(capsys):
    assert main(["inspect", "no_colon_here"]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err
    assert main(["inspect", "no_such_module_xyz:build"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_demo_prints_the_conversion_report(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "4/4 blocks converted to pre-norm" in out and "CHANGES the function" in out


def test_conversion_options_without_a_placement_are_refused_not_ignored(capsys):
    assert main(["inspect", "tests.test_placement_cli:build_encoder", "--no-final-norm"]) == 2
    assert "pass --placement" in capsys.readouterr().err


def test_a_bad_request_fails_before_the_model_is_built(capsys):
    assert main(["inspect", "no_such_module:f", "--placement", "post", "--branch-scale", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "branch_scale applies to pre-norm branches" in err and "no_such_module" not in err
