"""The model zoo: tiny transformers models built from config (no download), their data, and the rank function.

Every architecture is as small as keeps its structure (two layers, several heads, four experts for the
mixture of experts) with dropout off, so that infinity and plain PyTorch compute the same thing. Attention
key biases are frozen: their gradient is mathematically zero (softmax ignores a shift shared by all keys),
so Adam turns its rounding noise into lr-sized updates on which no two implementations agree (the same
reason the engine tests' GPTs have no biases); where a model fuses them with the query and value biases
(GPT-2, GPT-NeoX) the fused bias is frozen. A batch is a
dict of model inputs: causal LMs predict their own input ids, BERT a fixed number of masked tokens per row
(so every rank's half-batch holds as many targets, and the mean of the ranks' losses is the global one), T5
a target sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from harness import config, config_adamw
from torch import nn

VOCAB = 96
SEQ = 16
MASKED_PER_ROW = 4
MASK_ID = 3
CLIP = 1.0

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
_GQA = dict(_DECODER, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

# arch -> (config class, model class, config kwargs, task)
ZOO: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "causal",
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _GQA, "causal"),
    "mistral": ("MistralConfig", "MistralForCausalLM", _GQA, "causal"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA, "causal"),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(_DECODER, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
        "causal",
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
             bos_token_id=0, eos_token_id=0, pad_token_id=1),
        "causal",
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(_DECODER, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0),
        "causal",
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(_DECODER, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        "masked",
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8, vocab_size=VOCAB,
             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        "seq2seq",
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_GQA, num_local_experts=4, num_experts_per_tok=2),
        "causal",
    ),
}


KEY_BIASES = ("k_proj.bias", "self.key.bias", "attn.c_attn.bias", "attention.query_key_value.bias")


def build_zoo_model(arch: str, seed: int = 0) -> nn.Module:
    import transformers

    config_cls, model_cls, kwargs, _ = ZOO[arch]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    for name, p in model.named_parameters():
        if name.endswith(KEY_BIASES):
            p.requires_grad_(False)
    return model


def zoo_batches(arch: str, micro_bs: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> Iterator[dict]:
    """Rank r's rows [r*b, (r+1)*b) of global micro-batch s, drawn from a generator seeded by (seed, s)."""
    task = ZOO[arch][3]
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        rows = micro_bs * world_size
        ids = torch.randint(4, VOCAB, (rows, SEQ), generator=gen)
        if task == "causal":
            batch = {"input_ids": ids, "labels": ids}
        elif task == "masked":
            positions = torch.rand(rows, SEQ, generator=gen).argsort(dim=1)[:, :MASKED_PER_ROW]
            labels = torch.full_like(ids, -100)
            labels.scatter_(1, positions, ids.gather(1, positions))
            batch = {"input_ids": ids.scatter(1, positions, MASK_ID), "labels": labels}
        else:
            batch = {"input_ids": ids, "labels": torch.randint(4, VOCAB, (rows, SEQ // 2), generator=gen)}
        mine = slice(rank * micro_bs, (rank + 1) * micro_bs)
        yield {k: v[mine] for k, v in batch.items()}
        step += 1


def zoo_config(arch: str, micro_bs: int, nvme_path: str) -> dict:
    """Parameters and optimizer on NVMe; the architecture's layers as blocks; AdamW with clipping, fp32."""
    from infinity.models.hf import find_block_classes

    return config(
        micro_bs=micro_bs,
        clip=CLIP,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=nvme_path,
        block_classes=tuple(find_block_classes(build_zoo_model(arch))),
    )


def train_zoo(archs: list[str], steps: int, micro_bs: int, nvme_path: str) -> dict[str, dict]:
    """On this rank, train each architecture in turn with infinity: per-step losses, the full state, seconds."""
    import time

    import torch.distributed as dist

    import infinity

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    results = {}
    for arch in archs:
        start = time.perf_counter()
        engine = infinity.initialize(model=build_zoo_model(arch), config=zoo_config(arch, micro_bs, nvme_path))[0]
        data = zoo_batches(arch, micro_bs, rank=rank, world_size=world)
        losses = []
        for _ in range(steps):
            loss = engine(**next(data)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[arch] = {"losses": losses, "state": engine.full_state_dict(), "seconds": time.perf_counter() - start}
        engine.close()
    return results


def plain_zoo(
    arch: str, steps: int, global_bs: int, initial: dict[str, torch.Tensor] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The yardstick: the same model and global batches, torch.optim.AdamW, global-norm clipping, fp32 (the
    harness's `reference_train` with a transformers model's call: a dict of inputs in, `.loss` out); from the
    `initial` weights where given (every parameter), else from the model's seeded initialization."""
    model = build_zoo_model(arch)
    if initial is not None:
        missing, unexpected = model.load_state_dict(initial, strict=False)  # buffers may come or not
        assert {*missing, *unexpected} <= {n for n, _ in model.named_buffers()}, (missing, unexpected)
    opt = config_adamw(model)
    data = zoo_batches(arch, global_bs)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**next(data)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
