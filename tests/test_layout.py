"""model/layout.py: the table of every checkpoint tensor, and what is derived from it."""

import ast
import re
from dataclasses import fields, replace
from pathlib import Path

import gguf
import pytest

import tinyvllm
from tinyvllm.model.config import FAMILIES, Family
from tinyvllm.model.dummy import tiny_config
from tinyvllm.model.layout import (LAYOUTS, dimensions, gguf_name_map, gguf_permuted_heads, hf_name_of_gguf,
                                   layer_parts, layout_of, layout_of_architecture, model_parts, row_slices,
                                   tied_copies, weight_shapes)
from tinyvllm.model.weights import LayerWeights, ModelWeights

# the dense families (the mixture-of-experts ones' tables are checked against HF's loading in test_family_moe.py)
ARCHITECTURES = sorted(a for a, family in FAMILIES.items() if family.num_experts_key is None)
GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
              "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
              "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
LLAMA_NAMED = [a for a in ARCHITECTURES if layout_of_architecture(a) is LAYOUTS["llama"]]  # Llama's tensor names


def expected_shapes(config):
    """The tensors of an HF Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 checkpoint, spelled out by
    hand."""
    h, inter, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    arch = config.architecture
    top = "language_model." if arch == "Gemma3ForConditionalGeneration" else ""
    shapes = {top + "model.embed_tokens.weight": (v, h), top + "model.norm.weight": (h,),
              top + "lm_head.weight": (v, h)}
    for i in range(config.num_hidden_layers):
        p = f"{top}model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, inter)}
        if arch == "Phi3ForCausalLM":
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (inter, h),
                       p + "mlp.up_proj.weight": (inter, h)}
        if arch == "Qwen2ForCausalLM":
            shapes |= {p + f"self_attn.{n}_proj.bias": (q if n == "q" else kv,) for n in "qkv"}
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if arch.startswith("Gemma"):
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    return shapes


def config_of(architecture, **overrides):
    return tiny_config(architecture=architecture, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       **overrides)


def test_table_fields_are_the_weights_fields():
    names = [f.name for f in fields(LayerWeights)]
    assert {p.field for layout in LAYOUTS.values() for p in layout.layer} == set(names)
    for layout in set(LAYOUTS.values()):
        assert [p.field for p in layout.model] == [f.name for f in fields(ModelWeights) if f.name != "layers"]
        assert [p.field for p in layout.layer] == [n for n in names if n in {p.field for p in layout.layer}]
        family_flags = set(Family._fields) - {"model_type"}
        for packed in (*layout.model, *layout.layer):
            assert packed.flag is None or packed.flag in family_flags, packed
            assert all(set(part.shape) <= set(dimensions(tiny_config())) for part in packed.parts), packed
        # an optional part is a defaulted field: a family without it leaves it None
        defaults = {f.name for f in fields(LayerWeights) if f.default is None}
        assert {p.field for p in layout.layer if p.flag or p.mlp} <= defaults
        assert set(names) - defaults <= {p.field for p in layout.layer if not (p.flag or p.mlp)}


def test_every_family_has_a_layout():
    assert {family.model_type for family in FAMILIES.values()} <= set(LAYOUTS)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_weight_shapes_are_the_checkpoints(architecture, tied):
    config = config_of(architecture, tie_word_embeddings=tied)
    shapes = weight_shapes(config)
    assert shapes == expected_shapes(config)
    top = "language_model." if architecture == "Gemma3ForConditionalGeneration" else ""
    assert list(shapes)[:3] == [top + "model.embed_tokens.weight", top + "model.norm.weight", top + "lm_head.weight"]
    assert tied_copies(config) == ({top + "lm_head.weight": top + "model.embed_tokens.weight"} if tied else {})


@pytest.mark.parametrize("architecture", LLAMA_NAMED)
def test_parts_stack_in_order(architecture):
    config = config_of(architecture)
    assert model_parts(config) == {"embed": ["model.embed_tokens.weight"], "final_norm": ["model.norm.weight"],
                                   "lm_head": ["lm_head.weight"]}
    parts = layer_parts(config, 1)
    p = "model.layers.1."
    assert parts["qkv"] == [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
    assert parts["gate_up"] == [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    assert ("qkv_bias" in parts) == (architecture == "Qwen2ForCausalLM")
    assert ("q_norm" in parts and "k_norm" in parts) == (architecture == "Qwen3ForCausalLM")
    every = [name for names in model_parts(config).values() for name in names]
    every += [name for i in range(config.num_hidden_layers) for names in layer_parts(config, i).values()
              for name in names]
    assert sorted(every) == sorted(weight_shapes(config))
    q, k, v = row_slices(config, "qkv")
    assert (q, k, v) == (slice(0, 32), slice(32, 48), slice(48, 64))
    assert row_slices(config, "gate_up") == [slice(0, 128), slice(128, 256)]


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if FAMILIES[a].model_type in GGUF_ARCHS])
@pytest.mark.parametrize("tied", [False, True])
def test_gguf_names_are_llama_cpps(architecture, tied):
    if architecture.startswith("Gemma") and not tied:
        pytest.skip("Gemma ties its LM head: llama.cpp's gemma2 and gemma3 have no output tensor")
    config = config_of(architecture, tie_word_embeddings=tied)
    names = gguf_name_map(config)
    assert sorted(names.values()) == sorted(set(weight_shapes(config)) - set(tied_copies(config)))
    reference = gguf.get_tensor_name_map(GGUF_ARCHS[config.family.model_type], config.num_hidden_layers)
    for gguf_name, hf in names.items():
        assert reference.get_name(hf, try_suffixes=(".weight", ".bias")) == gguf_name, hf
        assert hf_name_of_gguf(config, gguf_name) == hf


def test_unknown_gguf_names():
    config = config_of("LlamaForCausalLM")
    for name in ("blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "blk.01.attn_q.weight", "blk.0attn_q.weight",
                 "token_embd.bias", "output", "rope_freqs.weight"):
        assert hf_name_of_gguf(config, name) is None, name
    # a Qwen tensor in a Llama file maps (the loader then refuses it as unexpected for the family)
    assert hf_name_of_gguf(config, "blk.7.attn_q_norm.weight") == "model.layers.7.self_attn.q_norm.weight"


@pytest.mark.parametrize("architecture", LLAMA_NAMED)
def test_gguf_permuted_rows_follow_the_family_flag(architecture, monkeypatch):
    config = config_of(architecture)
    permuted = gguf_permuted_heads(config)
    if config.family.gguf_permute_qk:
        assert permuted == {n: h for i in range(config.num_hidden_layers) for n, h in (
            (f"model.layers.{i}.self_attn.q_proj.weight", 4), (f"model.layers.{i}.self_attn.k_proj.weight", 2))}
    else:
        assert permuted == {}
    flipped = config.family._replace(gguf_permute_qk=not config.family.gguf_permute_qk)
    monkeypatch.setitem(FAMILIES, architecture, flipped)
    assert bool(gguf_permuted_heads(config)) != bool(permuted)


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of a module, the literal pieces of f-strings included."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def checkpoint_words() -> set[str]:
    """What spells a checkpoint tensor: each name of the table, without its .weight / .bias, and the words of the
    HF names that are not also the packed tensors' own (field) names."""
    field_names = {f.name for f in (*fields(LayerWeights), *fields(ModelWeights))}
    words = set()
    for layout in set(LAYOUTS.values()):
        words |= {layout.hf_layer.partition("{")[0], layout.gguf_layer.partition("{")[0], layout.gguf_rope_freqs,
                  *layout.hf_ignored}
        for packed in (*layout.model, *layout.layer):
            for part in packed.parts:
                for name in (part.hf, part.gguf):
                    base = name.rsplit(".", 1)[0]
                    words |= {name} | ({base} if ("_" in base or "." in base) and base not in field_names else set())
                words |= {w for w in part.hf.split(".") if "_" in w and w not in field_names}
    return words


NOT_YET_CHECKED: tuple[str, ...] = ()  # modules still naming checkpoint tensors themselves


def test_the_table_is_the_only_place_naming_checkpoint_tensors():
    words = checkpoint_words()
    assert {"self_attn", "mlp.gate_proj", "blk.", "model.layers.", "token_embd", "lm_head.weight"} <= words
    pattern = re.compile("|".join(rf"(?<!\w){re.escape(w)}(?!\w)" for w in sorted(words, key=len, reverse=True)))
    root = Path(tinyvllm.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative == "model/layout.py" or relative.startswith(NOT_YET_CHECKED):
            continue
        found += [f"{relative}:{line}: {text!r}" for line, text in string_literals(path) if pattern.search(text)]
    assert not found, "\n".join(found)


def test_the_word_check_catches_a_spelled_name(tmp_path):
    words = checkpoint_words()
    pattern = re.compile("|".join(rf"(?<!\w){re.escape(w)}(?!\w)" for w in sorted(words, key=len, reverse=True)))
    module = tmp_path / "m.py"
    module.write_text('a = f"model.layers.{i}.self_attn.{n}_proj.weight"\nb = "output.weight"\nc = "the output"\n'
                      'd = "q_norm"\ne = "mlp_bias"\n')
    hits = [line for line, text in string_literals(module) if pattern.search(text)]
    assert sorted(hits) == [1, 1, 2]


def test_layout_of_follows_the_family():
    assert layout_of(config_of("Qwen3ForCausalLM")) is LAYOUTS["qwen3"]
    config = replace(config_of("LlamaForCausalLM"), num_hidden_layers=3)
    assert len(weight_shapes(config)) == 3 + 3 * 9
