"""`infinity estimate --model FOLDER` and `infinity config --model FOLDER` size a Hugging Face model folder as
`infinity train --model FOLDER` builds it: on the meta device, its decoder layers the blocks."""

from __future__ import annotations

import argparse
import json

import pytest

from infinity.cli import main
from infinity.cli.estimate import model_size
from infinity.estimator import format_params

transformers = pytest.importorskip("transformers")

HIDDEN = 64


def llama_folder(tmp_path, tie: bool):
    """A folder holding only config.json: a Llama whose layers are larger than its embeddings and head."""
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=200,
        tie_word_embeddings=tie,
    )
    folder = tmp_path / "llama"
    config.save_pretrained(folder)
    return folder, config


@pytest.mark.parametrize("tie", [False, True])
def test_estimate_counts_a_folders_parameters_with_its_layers_as_blocks(tmp_path, capsys, tie):
    folder, config = llama_folder(tmp_path, tie)
    plain = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in plain.parameters())  # a tied head counted once
    layer = sum(p.numel() for p in plain.model.layers[0].parameters())
    size, label = model_size(argparse.Namespace(model=str(folder), params=None, largest_layer_params=None))
    assert (size.total_params, size.largest_block_params) == (total, layer)
    assert sum(size.flat_params) == total and size.flat_params.count(layer) == config.num_hidden_layers
    assert label == f"LlamaForCausalLM from {folder}: "
    assert main(["estimate", "--model", str(folder), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert f"{label}{format_params(total)} parameters (largest block {format_params(layer)})" in out
    assert "Best fit here:" in out


def test_config_resolves_auto_from_a_folders_hidden_size_and_names_it_in_the_fit_line(tmp_path, capsys):
    folder, _ = llama_folder(tmp_path, tie=False)
    ds = tmp_path / "ds.json"
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}))
    assert main(["config", str(ds), "--model", str(folder)]) == 0
    captured = capsys.readouterr()
    resolved = json.loads(captured.out)["zero_optimization"]
    assert resolved["reduce_bucket_size"] == HIDDEN * HIDDEN
    assert resolved["stage3_param_persistence_threshold"] == 10 * HIDDEN
    assert resolved["block_classes"] == ["LlamaDecoderLayer"]  # the folder's layers: the file names none
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("fit: stage 3") and f"LlamaForCausalLM from {folder} on 1 rank(s)" in line


@pytest.mark.parametrize("command", [["estimate"], ["config"]])
def test_a_model_that_is_neither_a_preset_nor_a_folder_is_refused_by_name(tmp_path, capsys, command):
    assert main([*command, "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert f"--model '{tmp_path / 'nowhere'}' is neither a GPT preset" in err and "config.json" in err
