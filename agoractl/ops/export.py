"""A trained run as a Hugging Face ``LlamaForCausalLM`` directory (report §4.1, §3.6.4).

The source is the run's global state dict — every stage's checkpoint at one step from
``checkpoints.store`` (a swarm), or the central run's checkpoint in ``<store>/central`` — under agoractl's
global names (``blocks.6.attn.wq.weight``). The reparameterized SSN is folded into dense matrices:
an output projection ``W = Z U_kᵀ`` (agoractl keeps ``Zᵀ``, so ``W = U_k · weight``, d × in) and the
token embedding ``T_fixed + E U_kᵀ``; ``U_k`` and ``T_fixed`` are rebuilt from ``model.ssn.seed``
exactly as the stages do. Rotary embedding uses the same half-split convention as Hugging Face's
Llama, so q/k projections are copied as they are.

The directory is written whole or not at all: everything goes to a temporary sibling directory,
which is renamed to ``--to`` at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import safetensors.torch
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from agoractl.data.tokenizers import BYTES_EOS
from agoractl.errors import RuntimeFailure, UsageError
from agoractl.manifest.schema import Run
from agoractl.model.subspace import fixed_token_embedding, orthonormal_basis
from agoractl.ops import resume
from agoractl.ops.checkpoint import CheckpointStore

EOS_TOKEN = "<|endoftext|>"
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
          "mlp.w2.weight": "mlp.down_proj.weight"}
_FOLDED = ("attn.wo.weight", "mlp.w2.weight")


def check_exportable(run: Run) -> None:
    if run.model.family != "llama":
        raise UsageError(f"model.family is {run.model.family}: only a Llama run exports to LlamaForCausalLM",
                         hint="export a run whose manifest has model.family: llama")


def hf_config(run: Run) -> dict:
    """``config.json`` of the exported model, mapped from ``model.*`` (fp32 weights, untied head)."""
    m = run.model
    eos = BYTES_EOS if run.tokenizer.kind == "bytes" else None
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu", "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": m.init_std, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": None,
    }


def hf_state(run: Run, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """agoractl's global state dict → Hugging Face Llama names, SSN factors folded into dense weights."""
    m = run.model
    basis = orthonormal_basis(m.d_model, m.ssn.rank, m.ssn.seed) if m.ssn.rank else None
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().to(torch.float32)
        if name == "embed.weight":
            if basis is not None:
                t = fixed_token_embedding(m.vocab_size, m.d_model, m.ssn.seed, m.init_std) + t @ basis.t()
            out["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            if rest not in _BLOCK:
                raise RuntimeFailure(f"tensor {name}: no Llama counterpart", hint="was it written by this agoractl?")
            if basis is not None and rest in _FOLDED:
                t = basis @ t  # W = Z U_kᵀ; agoractl holds Zᵀ [k, in] -> U_k Zᵀ = W [d, in]
            out[f"model.layers.{index}.{_BLOCK[rest]}"] = t
        else:
            raise RuntimeFailure(f"tensor {name}: no Llama counterpart", hint="was it written by this agoractl?")
    expected = 3 + 9 * m.n_layers
    if len(out) != expected:
        raise RuntimeFailure(f"the state holds {len(out)} of the model's {expected} tensors",
                             hint="export needs every stage's checkpoint at one step")
    return {k: v.contiguous() for k, v in out.items()}


def state_from_store(run: Run, step: Optional[int] = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Every stage's checkpoint at one step, merged: `step`, or the latest step all stages have."""
    store = CheckpointStore(run)
    names = run.stage_names()
    steps = {s: store.steps(s) for s in names}
    missing = [s for s in names if not steps[s]]
    if missing:
        raise RuntimeFailure(f"{store.url}: no checkpoint of stage {missing[0]}"
                             + (f" (nor of {', '.join(missing[1:])})" if missing[1:] else ""),
                             hint="export and eval need every stage; publish the missing one, or train longer")
    if step is None:
        latest = {s: store.latest_step(s) for s in names}
        if len(set(latest.values())) != 1:
            shown = ", ".join(f"{s} at {v}" for s, v in latest.items())
            common = sorted(set.intersection(*(set(v) for v in steps.values())))
            hint = f"pass --step {common[-1]} (a step every stage has)" if common else \
                "no step is held by every stage; publish the stages at one step"
            raise RuntimeFailure(f"{store.url}: the stages' latest checkpoints are at different steps ({shown})",
                                 hint=hint)
        step = next(iter(latest.values()))
    else:
        lacking = [s for s in names if step not in steps[s]]
        if lacking:
            raise RuntimeFailure(f"{store.url}: stage {lacking[0]} has no checkpoint at step {step}",
                                 hint=f"its steps: {', '.join(map(str, steps[lacking[0]]))}")
    state: dict[str, torch.Tensor] = {}
    for s in names:
        state.update(store.load(s, step).model_state)
    return step, state


def state_from_central(run: Run, step: Optional[int] = None) -> tuple[int, dict[str, torch.Tensor]]:
    """The centralized reference's checkpoint (``<checkpoints.store>/central``, written by ``launch
    central`` every ``checkpoints.every_steps`` and after its last step): `step`, or its latest."""
    store = resume.central_store(run)
    if not store.steps(resume.CENTRAL_STAGE):
        raise RuntimeFailure(f"{store.url}: no checkpoint of the central run",
                             hint="run `agoractl launch central FILE` with checkpoints.every_steps > 0 first")
    step = store.resolve(resume.CENTRAL_STAGE, step)
    return step, store.load(resume.CENTRAL_STAGE, step).model_state


def bytes_tokenizer_json() -> str:
    """agoractl's bytes tokenizer (ids 0-255 = bytes, 256 = EOS) as a ``tokenizers`` JSON: byte-level
    BPE with no merges, so every byte is one token with its own id."""
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    if set(vocab) != set(ByteLevel.alphabet()):  # the 256 printable stand-ins of the byte-level scheme
        raise RuntimeFailure("this tokenizers release uses another byte-level alphabet; the bytes tokenizer "
                             "cannot be exported with it")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    if tok.token_to_id(EOS_TOKEN) != BYTES_EOS:
        raise RuntimeFailure(f"the bytes tokenizer's EOS got id {tok.token_to_id(EOS_TOKEN)}, not {BYTES_EOS}")
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE convention (GPT-2): printable bytes map to themselves, the rest to 256+."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_tokenizer(run: Run, directory: Path) -> None:
    if run.tokenizer.kind == "bytes":
        (directory / "tokenizer.json").write_text(bytes_tokenizer_json())
        eos = EOS_TOKEN
    else:
        src = Path(run.tokenizer.path or "")
        src = src / "tokenizer.json" if src.is_dir() else src
        if not src.is_file():
            raise UsageError(f"tokenizer.path {run.tokenizer.path}: no tokenizer.json to export")
        shutil.copyfile(src, directory / "tokenizer.json")
        eos = run.tokenizer.eos_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": run.model.seq_len,
              "clean_up_tokenization_spaces": False}
    if eos:
        config["eos_token"] = eos
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_export(run: Run, state: dict[str, torch.Tensor], step: int, to: Path, source: str,
                 max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write the Hugging Face directory `to` (new or empty): config, weights (sharded above
    `max_shard_bytes`), tokenizer; all in a temporary sibling renamed at the end."""
    tensors = hf_state(run, state)
    to = Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UsageError(f"--to {to}: exists and is not an empty directory", hint="choose a new directory")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", dir=to.parent))
    try:
        config = hf_config(run)
        config["agoractl"] = {"run": run.metadata.name, "step": step, "source": source,
                              "ssn_rank": run.model.ssn.rank}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": config["eos_token_id"], "do_sample": False}, indent=2) + "\n")
        _write_weights(tensors, tmp, max_shard_bytes)
        _write_tokenizer(run, tmp)
        if to.exists():
            to.rmdir()
        os.replace(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def _write_weights(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def load_exported(directory: Path):
    """An exported directory loaded with transformers (the ``export`` extra), fp32, eval mode, offline."""
    try:
        from transformers import AutoModelForCausalLM  # optional: agoractl[export]
    except ImportError:
        raise UsageError("transformers is not installed", hint="pip install 'agoractl[export]'") from None
    return AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                dtype=torch.float32).eval()
