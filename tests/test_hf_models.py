"""Hugging Face folders: built without weights, blocks found from the architecture, weights streamed in and out.

Each loaded model is compared with transformers' own copy of the same weights (the model that wrote the
folder, or `from_pretrained` of a folder infinity wrote). One rank, parameters and optimizer on NVMe, so
every weight really goes through the shards.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hf_cases import save_tiny_llama
from zoo_cases import ZOO, build_zoo_model

import infinity
from infinity.models.hf import find_block_classes, load_hf_folder, require_transformers, save_hf_folder
from infinity.models.hf_weights import checkpoint_tensors

transformers = pytest.importorskip("transformers")


def _engine(model, nvme, block_classes):
    nvme.mkdir(exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": list(block_classes),
            "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        },
    }
    return infinity.initialize(model=model, config=cfg)[0]


def _plain_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


EXPECTED_BLOCKS = {
    "gpt2": ("GPT2Block",),
    "llama": ("LlamaDecoderLayer",),
    "opt": ("OPTDecoderLayer",),
    "gpt_neox": ("GPTNeoXLayer",),
    "bert": ("BertLayer",),  # its _no_split_modules also names BertEmbeddings, which does not repeat
    "t5": ("T5Block",),
    "mixtral": ("MixtralDecoderLayer",),  # not its experts, a list nested in each layer
}


@pytest.mark.parametrize("arch", sorted(EXPECTED_BLOCKS))
def test_blocks_are_the_architectures_repeated_layers(arch):
    assert find_block_classes(build_zoo_model(arch)) == EXPECTED_BLOCKS[arch]


def test_without_declared_layers_the_repeated_list_children_are_the_blocks():
    from infinity.models.gpt import GPT, gpt_preset

    assert find_block_classes(GPT(gpt_preset("tiny"))) == ("Block",)


def test_a_folder_is_built_with_meta_parameters_and_real_buffers(tmp_path):
    model = save_tiny_llama(tmp_path / "llama")
    hf = load_hf_folder(tmp_path / "llama")
    assert all(p.is_meta for p in hf.model.parameters())
    buffers = dict(hf.model.named_buffers())
    assert buffers and not any(b.is_meta for b in buffers.values())
    for name, buf in model.named_buffers():  # the rotary tables, computed as transformers computes them
        assert torch.equal(buffers[name], buf), name
    assert hf.block_classes == ("LlamaDecoderLayer",) and hf.tokenizer is not None


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_safetensors_with_an_index_stream_into_the_shards(tmp_path, tied):
    model = save_tiny_llama(tmp_path / "llama", tie_word_embeddings=tied)
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    hf = load_hf_folder(tmp_path / "llama")
    engine = _engine(hf.model, tmp_path / "nvme", hf.block_classes)
    assert engine.load_full_state(checkpoint_tensors(hf.folder, hf.model)) == []
    state, expected = engine.full_state_dict(), _plain_state(model)
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    engine.close()


def test_a_single_torch_weight_file_streams_in(tmp_path):
    model = save_tiny_llama(tmp_path / "llama", max_shard_size=None)
    folder = tmp_path / "llama"
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    hf = load_hf_folder(folder)
    engine = _engine(hf.model, tmp_path / "nvme", hf.block_classes)
    engine.load_full_state(checkpoint_tensors(folder, hf.model))
    for key, value in _plain_state(model).items():
        assert torch.equal(engine.full_state_dict()[key], value), key
    engine.close()


def test_experts_stored_one_by_one_load_into_fused_expert_parameters(tmp_path):
    """transformers saves a Mixtral's experts as separate matrices and fuses them into one parameter per
    layer at load; infinity assembles the fused parameters from the stored matrices the same way."""
    model = build_zoo_model("mixtral")
    model.save_pretrained(tmp_path / "moe", max_shard_size="40KB")
    stored = checkpoint_tensors(tmp_path / "moe", model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored
    hf = load_hf_folder(tmp_path / "moe")
    engine = _engine(hf.model, tmp_path / "nvme", hf.block_classes)
    assert engine.load_full_state(checkpoint_tensors(hf.folder, hf.model)) == []
    state = engine.full_state_dict()
    for key, value in _plain_state(model).items():
        assert torch.equal(state[key], value), key
    engine.close()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_written_folder_loads_back_in_transformers_with_the_engines_weights(tmp_path, arch):
    if arch == "llama":
        save_tiny_llama(tmp_path / "src", tie_word_embeddings=True)
    else:
        build_zoo_model("mixtral").save_pretrained(tmp_path / "src")
    hf = load_hf_folder(tmp_path / "src")
    engine = _engine(hf.model, tmp_path / "nvme", hf.block_classes)
    engine.load_full_state(checkpoint_tensors(hf.folder, hf.model))
    with torch.no_grad():  # new weights, so the check cannot pass by copying the source files
        for p in hf.model.parameters():
            with infinity.GatheredParameters([p], modifier_rank=0):
                p.add_(0.5)
    save_hf_folder(engine, hf, tmp_path / "out", max_shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    state = engine.full_state_dict()
    assert set(_plain_state(loaded)) == set(state)
    for key, value in _plain_state(loaded).items():
        assert torch.equal(value, state[key]), key
    engine.close()


def test_a_shard_missing_from_the_index_is_named(tmp_path):
    save_tiny_llama(tmp_path / "llama")
    shard = sorted((tmp_path / "llama").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        checkpoint_tensors(tmp_path / "llama", load_hf_folder(tmp_path / "llama").model)


def test_without_transformers_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'infinity\[hf\]'"):
        require_transformers()


def test_zoo_lists_every_architecture_of_the_issue():
    assert {"gpt2", "llama", "mistral", "qwen2", "phi", "opt", "gpt_neox", "bert", "t5", "mixtral"} <= set(ZOO)
