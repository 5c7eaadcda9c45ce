"""The model as data: every tensor of a family's checkpoint, in both file formats, and how the backends pack them.

This is the one place that names a checkpoint tensor. A packed tensor (a field of ModelWeights or LayerWeights)
stacks the rows of its parts in order (Q, K, V into qkv; gate, up into gate_up); each part names its tensor in an HF
checkpoint and in a GGUF file and gives its shape in dimensions of the ModelConfig (`dimensions`). A packed tensor
the family adds to Llama's layer carries the Family flag it is present under (Qwen2's Q/K/V biases, Qwen3's q/k
norms); everything else is derived from the table: the tensors a checkpoint must hold (`weight_shapes`), what each
packed tensor stacks (`model_parts`, `layer_parts`), the GGUF names (`hf_name_of_gguf`), and which GGUF rows
llama.cpp interleaves (`gguf_permuted_heads`).

A mixture-of-experts layer's experts are packed stacked: a Packed with `experts` set holds, for each expert e in
order, its parts' rows one after another ("{e}" in a part's name is the expert's index), as one array
[num_experts, rows, columns] (experts_gate_up [E, 2 * I, hidden], experts_down [E, hidden, I]), so that a per-expert
per-output-channel scale is [E, rows]. A Packed's `mlp` says in which layers it is present: "moe" in the layers
whose MLP is the experts (ModelConfig.moe_layer), "dense" in the others; None in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tinyvllm.model.config import FAMILIES, ModelConfig

ROUTER = "router"  # the field of an expert layer's router (kept float32 under FP8, as vLLM keeps it)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor. A layer's names follow the layer's prefix (Layout.hf_layer / gguf_layer)."""

    hf: str
    gguf: str
    shape: tuple[str, ...]  # keys of dimensions(config): ("q", "hidden") is [heads * head_dim, hidden]
    # llama.cpp stores this tensor's rows interleaved per head, for a family whose gguf_permute_qk is set: the
    # ModelConfig field that counts those heads
    gguf_heads: str | None = None
    # a checkpoint tensor that is itself several stacked (Phi-3's qkv_proj): the dimensions of its row blocks
    splits: tuple[str, ...] = ()


@dataclass(frozen=True)
class Packed:
    """A packed tensor: a field of ModelWeights or LayerWeights, its parts' rows one after another."""

    field: str
    parts: tuple[Part, ...]
    flag: str | None = None  # the Family flag it is present under; None: every family has it
    tied_to: str | None = None  # the field it is (not a copy of) when the config ties word embeddings
    experts: bool = False  # stacked over the experts: its parts' names hold "{e}"
    mlp: str | None = None  # "moe": only in the expert layers; "dense": only in the others; None: in every layer


@dataclass(frozen=True)
class Layout:
    """A family's checkpoint: the model's packed tensors outside the layers, and one layer's."""

    model: tuple[Packed, ...]
    layer: tuple[Packed, ...]
    hf_layer: str = "model.layers.{i}."
    gguf_layer: str = "blk.{i}."
    hf_ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved; rebuilt from the config
    hf_skipped: tuple[str, ...] = ()  # prefixes of checkpoint tensors the model does not run (a vision tower)
    gguf_rope_freqs: str = "rope_freqs.weight"  # Llama 3 RoPE scaling as a tensor, folded into ModelConfig
    # An FP8 checkpoint's scales (vLLM's names), named after a linear layer's weight with its last word replaced:
    # the weight's own (per tensor, row or block; fp8's block scales are weight_scale_inv) and the static activation
    # scale; its KV cache scales, after a layer's prefix: K's, V's (compressed-tensors' and ModelOpt's names) and the
    # deprecated one for both (model/kv_scales.py); and the names that end the scales of FP8 attention, which the
    # engine does not run (ignored)
    hf_weight_scales: tuple[str, ...] = ("weight_scale", "weight_scale_inv")
    hf_input_scale: str = "input_scale"
    hf_k_scale: tuple[str, ...] = ("self_attn.k_scale", "self_attn.k_proj.k_scale")
    hf_v_scale: tuple[str, ...] = ("self_attn.v_scale", "self_attn.v_proj.v_scale")
    hf_kv_scale: str = "self_attn.kv_scale"
    hf_attention_scales: tuple[str, ...] = (".q_scale", ".prob_scale", ".output_scale")
    # LongRoPE's long and short factors as tensors (Phi-3), folded into ModelConfig too
    gguf_rope_factors: tuple[str, str] = ("rope_factors_long.weight", "rope_factors_short.weight")

    def packed(self, field: str) -> Packed:
        """The packed tensor of a ModelWeights or LayerWeights field."""
        return next(p for p in (*self.model, *self.layer) if p.field == field)


def _packed(field: str, *parts: Part, flag: str | None = None, tied_to: str | None = None) -> Packed:
    return Packed(field, parts, flag, tied_to)


LLAMA = Layout(
    model=(
        _packed("embed", Part("model.embed_tokens.weight", "token_embd.weight", ("vocab", "hidden"))),
        _packed("final_norm", Part("model.norm.weight", "output_norm.weight", ("hidden",))),
        _packed("lm_head", Part("lm_head.weight", "output.weight", ("vocab", "hidden")), tied_to="embed"),
    ),
    layer=(
        _packed("input_norm", Part("input_layernorm.weight", "attn_norm.weight", ("hidden",))),
        _packed("post_norm", Part("post_attention_layernorm.weight", "ffn_norm.weight", ("hidden",))),
        _packed("qkv", Part("self_attn.q_proj.weight", "attn_q.weight", ("q", "hidden"), "num_attention_heads"),
                Part("self_attn.k_proj.weight", "attn_k.weight", ("kv", "hidden"), "num_key_value_heads"),
                Part("self_attn.v_proj.weight", "attn_v.weight", ("kv", "hidden"))),
        _packed("o", Part("self_attn.o_proj.weight", "attn_output.weight", ("hidden", "q"))),
        _packed("gate_up", Part("mlp.gate_proj.weight", "ffn_gate.weight", ("intermediate", "hidden")),
                Part("mlp.up_proj.weight", "ffn_up.weight", ("intermediate", "hidden"))),
        _packed("down", Part("mlp.down_proj.weight", "ffn_down.weight", ("hidden", "intermediate"))),
        _packed("qkv_bias", Part("self_attn.q_proj.bias", "attn_q.bias", ("q",)),
                Part("self_attn.k_proj.bias", "attn_k.bias", ("kv",)),
                Part("self_attn.v_proj.bias", "attn_v.bias", ("kv",)), flag="attention_bias"),
        _packed("q_norm", Part("self_attn.q_norm.weight", "attn_q_norm.weight", ("head_dim",)), flag="qk_norm"),
        _packed("k_norm", Part("self_attn.k_norm.weight", "attn_k_norm.weight", ("head_dim",)), flag="qk_norm"),
    ),
)


def _replaced(layout: Layout, **fields: Packed) -> tuple[Packed, ...]:
    """The layer's packed tensors with those named replaced, and the new ones appended."""
    out = tuple(fields.pop(p.field, p) for p in layout.layer)
    return out + tuple(fields.values())


# Phi-3 stores Q, K, V as one tensor, and gate and up as another.
PHI3 = Layout(model=LLAMA.model, layer=_replaced(
    LLAMA,
    qkv=_packed("qkv", Part("self_attn.qkv_proj.weight", "attn_qkv.weight", ("qkv", "hidden"), splits=("q", "kv", "kv"))),
    gate_up=_packed("gate_up", Part("mlp.gate_up_proj.weight", "ffn_up.weight", ("gate_up", "hidden"),
                                    splits=("intermediate", "intermediate")))))
# Gemma 2 and 3: the norm before the MLP is pre_feedforward_layernorm; post_attention_layernorm and
# post_feedforward_layernorm normalize the attention's and the MLP's outputs before each joins the residual stream.
GEMMA = Layout(model=LLAMA.model, layer=_replaced(
    LLAMA,
    post_norm=_packed("post_norm", Part("pre_feedforward_layernorm.weight", "ffn_norm.weight", ("hidden",))),
    attn_out_norm=_packed("attn_out_norm", Part("post_attention_layernorm.weight", "post_attention_norm.weight",
                                                ("hidden",)), flag="sandwich_norms"),
    mlp_out_norm=_packed("mlp_out_norm", Part("post_feedforward_layernorm.weight", "post_ffw_norm.weight",
                                              ("hidden",)), flag="sandwich_norms")))


def _prefixed(layout: Layout, prefix: str, skipped: tuple[str, ...]) -> Layout:
    """The layout of a checkpoint that holds this one's HF tensors under `prefix` beside others it skips."""
    def moved(packed: tuple[Packed, ...]) -> tuple[Packed, ...]:
        return tuple(replace(p, parts=tuple(replace(part, hf=prefix + part.hf) for part in p.parts)) for p in packed)

    return replace(layout, model=moved(layout.model), layer=layout.layer, hf_layer=prefix + layout.hf_layer,
                   hf_skipped=skipped)


def moe_layout(base: Layout, block: str, gate: str, up: str, down: str, norm_shapes: tuple[str, str] | None = None
               ) -> Layout:
    """base with a mixture-of-experts MLP in the sparse layers (the router `block`.gate and the experts
    `block`.experts.{e}.<gate|up|down>), base's dense MLP in the others; norm_shapes: the q/k norms' shapes."""
    experts = block + ".experts.{e}."
    layer = []
    for p in base.layer:
        if p.field in ("gate_up", "down"):
            p = replace(p, mlp="dense")
        if norm_shapes and p.field in ("q_norm", "k_norm"):
            shape = norm_shapes[p.field == "k_norm"]
            p = replace(p, parts=tuple(replace(part, shape=(shape,)) for part in p.parts))
        layer.append(p)
    moe = (
        Packed(ROUTER, (Part(block + ".gate.weight", "ffn_gate_inp.weight", ("experts", "hidden")),), mlp="moe"),
        Packed("experts_gate_up", (Part(experts + gate, "ffn_gate_exps.weight", ("expert_intermediate", "hidden")),
                                   Part(experts + up, "ffn_up_exps.weight", ("expert_intermediate", "hidden"))),
               experts=True, mlp="moe"),
        Packed("experts_down", (Part(experts + down, "ffn_down_exps.weight", ("hidden", "expert_intermediate")),),
               experts=True, mlp="moe"),
    )
    return replace(base, layer=(*layer, *moe))


MIXTRAL = moe_layout(LLAMA, "block_sparse_moe", "w1.weight", "w3.weight", "w2.weight")
QWEN3_MOE = moe_layout(LLAMA, "mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
# OLMoE's q/k norms are over the whole projection: [heads * head_dim] and [kv_heads * head_dim]
OLMOE = moe_layout(LLAMA, "mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight", norm_shapes=("q", "kv"))

# Family.model_type -> its checkpoint layout. Llama's four families share its names; what Qwen adds is flagged. A
# Gemma 3 multimodal checkpoint holds the language model under language_model.
LAYOUTS = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "phi3": PHI3, "gemma2": GEMMA,
           "gemma3_text": GEMMA,
           "gemma3": _prefixed(GEMMA, "language_model.", ("vision_tower.", "multi_modal_projector.")),
           "mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "olmoe": OLMOE}


def layout_of(config: ModelConfig) -> Layout:
    return layout_of_architecture(config.architecture)


def layout_of_architecture(architecture: str) -> Layout:
    """The layout of an HF architecture (a key of config.FAMILIES)."""
    return LAYOUTS[FAMILIES[architecture].model_type]


def dimensions(config: ModelConfig) -> dict[str, int]:
    """The sizes a Part's shape is spelled in."""
    d = config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"vocab": config.vocab_size, "hidden": config.hidden_size, "intermediate": config.intermediate_size,
            "q": q, "kv": kv, "head_dim": d, "qkv": q + 2 * kv, "gate_up": 2 * config.intermediate_size,
            "experts": config.num_experts, "expert_intermediate": config.moe_intermediate_size}


def present(packed: Packed, config: ModelConfig, layer: int | None = None) -> bool:
    """Whether the config's family has this packed tensor (in layer `layer`, for one whose `mlp` is set)."""
    if packed.mlp is not None and layer is not None and (packed.mlp == "moe") != config.moe_layer(layer):
        return False
    return packed.flag is None or getattr(config.family, packed.flag)


def part_names(packed: Packed, part: Part, prefix: str, config: ModelConfig) -> list[str]:
    """The HF names of one part of a layer's packed tensor: one per expert for a stacked one."""
    if not packed.experts:
        return [prefix + part.hf]
    return [prefix + part.hf.format(e=e) for e in range(config.num_experts)]


def expert_names(packed: Packed, prefix: str, config: ModelConfig) -> list[str]:
    """A stacked packed tensor's HF names in its packed order: expert 0's parts, then expert 1's, ..."""
    return [prefix + part.hf.format(e=e) for e in range(config.num_experts) for part in packed.parts]


def stacked_experts(config: ModelConfig) -> set[str]:
    """The layer fields stacked over the experts ([num_experts, rows, columns] once packed)."""
    return {p.field for p in layout_of(config).layer if p.experts and present(p, config)}


def model_parts(config: ModelConfig) -> dict[str, list[str]]:
    """The packed tensors outside the layers (ModelWeights' fields) -> the HF tensors each one stacks, in order.
    A tied LM head is listed under its own name: the loaders make that name the embedding (tied_copies)."""
    return {p.field: [part.hf for part in p.parts] for p in layout_of(config).model if present(p, config)}


def layer_parts(config: ModelConfig, i: int) -> dict[str, list[str]]:
    """Layer i's packed tensors (LayerWeights' fields; the family's extras only where it has them) -> the HF
    tensors whose rows each one stacks, in order."""
    layout = layout_of(config)
    prefix = layout.hf_layer.format(i=i)
    return {p.field: expert_names(p, prefix, config) if p.experts else [prefix + part.hf for part in p.parts]
            for p in layout.layer if present(p, config, i)}


def tied_copies(config: ModelConfig) -> dict[str, str]:
    """HF name -> the HF name of the tensor it is, where the config ties them (the LM head and the embedding)."""
    if not config.tie_word_embeddings:
        return {}
    model = {p.field: p for p in layout_of(config).model}
    return {p.parts[0].hf: model[p.tied_to].parts[0].hf for p in model.values() if p.tied_to}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its HF shape (the family's biases and q/k norms included; the LM head
    also where it is tied)."""
    layout, dims = layout_of(config), dimensions(config)

    def shapes(packed: tuple[Packed, ...], prefix: str, i: int | None = None) -> dict[str, tuple[int, ...]]:
        return {name: tuple(dims[n] for n in part.shape) for p in packed if present(p, config, i)
                for part in p.parts for name in part_names(p, part, prefix, config)}

    out = shapes(layout.model, "")
    for i in range(config.num_hidden_layers):
        out |= shapes(layout.layer, layout.hf_layer.format(i=i), i)
    return out


def linear_weights(config: ModelConfig) -> list[str]:
    """The HF names of every layer's linear-layer weights (the parts of its matrices; each expert's), the ones FP8
    quantizes; not the routers (ROUTER), which run unquantized."""
    layout, names = layout_of(config), []
    for i in range(config.num_hidden_layers):
        prefix = layout.hf_layer.format(i=i)
        names += [name for p in layout.layer if present(p, config, i) and p.field != ROUTER for part in p.parts
                  if len(part.shape) == 2 for name in part_names(p, part, prefix, config)]
    return names


def router_weights(config: ModelConfig) -> list[str]:
    """The HF names of every expert layer's router weight."""
    layout = layout_of(config)
    return [layout.hf_layer.format(i=i) + part.hf for i in range(config.num_hidden_layers) for p in layout.layer
            if p.field == ROUTER and present(p, config, i) for part in p.parts]


def fp8_scale_names(config: ModelConfig, weight: str) -> tuple[list[str], str]:
    """The names an FP8 checkpoint may give a linear weight's scale (either), and its static input scale."""
    layout = layout_of(config)
    base = weight.rpartition(".")[0] + "."
    return [base + name for name in layout.hf_weight_scales], base + layout.hf_input_scale


def row_slices(config: ModelConfig, field: str) -> list[slice]:
    """The rows of each part of one of a layer's packed tensors (qkv: Q's, K's, V's), in its packed order; a fused
    part's row blocks (Part.splits) each count as a part."""
    dims, start, out = dimensions(config), 0, []
    for part in layout_of(config).packed(field).parts:
        for rows in part.splits or part.shape[:1]:
            out.append(slice(start, start + dims[rows]))
            start = out[-1].stop
    return out


NORM_FIELDS = ("final_norm", "input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")  # gains


def norm_names(config: ModelConfig) -> set[str]:
    """The HF names of every RMSNorm gain of the model (those a family's norm_offset applies to)."""
    names = {n for field, names in model_parts(config).items() if field in NORM_FIELDS for n in names}
    for i in range(config.num_hidden_layers):
        names |= {n for field, names in layer_parts(config, i).items() if field in NORM_FIELDS for n in names}
    return names


def fused_parts(config: ModelConfig) -> list[str]:
    """The HF tensors of a layer that stack several of Llama's (Phi-3's qkv_proj, gate_up_proj)."""
    return [part.hf for p in layout_of(config).layer if present(p, config) for part in p.parts if part.splits]


def hf_name_of_gguf(config: ModelConfig, name: str) -> str | None:
    """The HF name of a GGUF tensor (of any packed tensor of the layout, the family's or not); None for one the
    layout does not know."""
    layout = layout_of(config)
    by_gguf = {part.gguf: part.hf for p in layout.model for part in p.parts}
    if name in by_gguf:
        return by_gguf[name]
    head, _, rest = layout.gguf_layer.partition("{i}")
    index, dot, suffix = name.removeprefix(head).partition(rest)
    if not name.startswith(head) or not dot or not index.isdigit() or index != str(int(index)):
        return None
    by_gguf = {part.gguf: part.hf for p in layout.layer for part in p.parts}
    return layout.hf_layer.format(i=int(index)) + by_gguf[suffix] if suffix in by_gguf else None


def gguf_name_map(config: ModelConfig) -> dict[str, str]:
    """GGUF name -> HF name of every tensor the config's model holds (weight_shapes' names but the tied head's)."""
    layout, out = layout_of(config), {}
    for p in layout.model:
        if present(p, config) and not (p.tied_to and config.tie_word_embeddings):
            out |= {part.gguf: part.hf for part in p.parts}
    for i in range(config.num_hidden_layers):
        hf, gguf = layout.hf_layer.format(i=i), layout.gguf_layer.format(i=i)
        out |= {gguf + part.gguf: hf + part.hf for p in layout.layer if present(p, config) for part in p.parts}
    return out


def gguf_experts(config: ModelConfig) -> dict[str, list[str]]:
    """GGUF name -> the HF names of its experts in expert order, for each part of a stacked packed tensor: a GGUF file
    holds one [experts, rows, columns] tensor per part (ffn_gate_exps: every expert's gate)."""
    layout, out = layout_of(config), {}
    for i in range(config.num_hidden_layers):
        hf, gguf = layout.hf_layer.format(i=i), layout.gguf_layer.format(i=i)
        out |= {gguf + part.gguf: part_names(p, part, hf, config) for p in layout.layer
                if p.experts and present(p, config, i) for part in p.parts}
    return out


def gguf_permuted_heads(config: ModelConfig) -> dict[str, int]:
    """HF name -> head count of every tensor whose rows a GGUF file holds interleaved per head (llama.cpp's
    rotate-pairs RoPE layout), for a family with gguf_permute_qk; {} otherwise."""
    if not config.family.gguf_permute_qk:
        return {}
    layout, out = layout_of(config), {}
    for i in range(config.num_hidden_layers):
        prefix = layout.hf_layer.format(i=i)
        out |= {prefix + part.hf: getattr(config, part.gguf_heads) for p in layout.layer if present(p, config)
                for part in p.parts if part.gguf_heads}
    return out
