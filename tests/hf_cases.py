"""A tiny Llama folder as `save_pretrained` writes it (no download), a tokenizer trained here, text to train on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from infinity.data.corpus import load_corpus


def corpus_text(chars: int = 40_000) -> str:
    return bytes(load_corpus()[:chars].tolist()).decode("utf-8", "replace")


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on the bundled corpus, with an end-of-sequence token."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus_text()], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def save_tiny_llama(folder: Path, tie_word_embeddings: bool = False, max_shard_size: str | None = "40KB"):
    """A tiny Llama and its tokenizer written by save_pretrained (sharded, with an index); returns the model."""
    import transformers

    tokenizer = tiny_tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size=max_shard_size) if max_shard_size else model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def write_jsonl(path: Path, documents: int = 60, chars: int = 400) -> Path:
    text = corpus_text(documents * chars)
    with path.open("w") as f:
        for i in range(documents):
            f.write(json.dumps({"text": text[i * chars : (i + 1) * chars], "id": i}) + "\n")
    return path
