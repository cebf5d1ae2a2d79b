"""Small GGUF files of the families Ollama serves, in its usual quantizations, written with `gguf`.

One layer of width 256 (a K-quant block), a byte-level BPE vocabulary of 300 tokens and a ChatML
template: real files that the importer converts and `mlx_lm.load` loads. gguf writes no K-quants, so
their blocks are random bytes with small float16 scales: finite weights, as a real file has.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize


def b2u():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


F16_AT = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def qbytes(rng, qtype, rows, cols):
    if qtype in (T.F32, T.F16):
        return rng.normal(0, 0.02, (rows, cols)).astype(np.float32 if qtype == T.F32 else np.float16)
    if qtype in (T.Q8_0, T.Q4_0):
        return quantize(rng.normal(0, 0.02, (rows, cols)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_AT.get(qtype, ()):  # a type with no scales here is one the importer refuses
        data[:, :, at : at + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write(path, arch, mix, *, hidden=256, ff=512, heads=4, kv=2, vocab=300, layers=1):
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    head_dim = hidden // heads
    w.add_name(f"tiny {arch}")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(512)
    toks = b2u() + ["<|im_start|>", "<|im_end|>"] + [f"<x{i}>" for i in range(vocab - 258)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * 2 + [1] * (vocab - 258))
    w.add_token_merges([])
    w.add_eos_token_id(257)
    w.add_bos_token_id(256)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def t(name, rows, cols, kind):
        q = mix.get(kind, mix["default"]) if kind != "norm" else T.F32
        if kind == "norm":
            w.add_tensor(name, np.ones(cols, dtype=np.float32))
            return
        data = qbytes(rng, q, rows, cols)
        w.add_tensor(name, data) if q in (T.F32, T.F16) else w.add_tensor(name, data, raw_dtype=q)

    t("token_embd.weight", vocab, hidden, "embd")
    t("output_norm.weight", 1, hidden, "norm")
    if arch not in ("gemma3",):
        t("output.weight", vocab, hidden, "output")
    for i in range(layers):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", 1, hidden, "norm")
        if arch == "phi3":
            t(p + "attn_qkv.weight", hidden + 2 * kv * head_dim, hidden, "attn_v")
            t(p + "ffn_up.weight", 2 * ff, hidden, "default")
        else:
            t(p + "attn_q.weight", heads * head_dim, hidden, "default")
            t(p + "attn_k.weight", kv * head_dim, hidden, "default")
            t(p + "attn_v.weight", kv * head_dim, hidden, "attn_v")
            t(p + "ffn_gate.weight", ff, hidden, "default")
            t(p + "ffn_up.weight", ff, hidden, "default")
        t(p + "attn_output.weight", hidden, heads * head_dim, "default")
        t(p + "ffn_down.weight", hidden, ff, "ffn_down")
        t(p + "ffn_norm.weight", 1, hidden, "norm")
        if arch == "qwen2":
            for n, d in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
                w.add_tensor(p + f"attn_{n}.bias", np.zeros(d, dtype=np.float32))
        if arch in ("qwen3", "gemma3"):
            t(p + "attn_q_norm.weight", 1, head_dim, "norm")
            t(p + "attn_k_norm.weight", 1, head_dim, "norm")
        if arch == "gemma3":
            t(p + "post_attention_norm.weight", 1, hidden, "norm")
            t(p + "post_ffw_norm.weight", 1, hidden, "norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MIXES = {
    "Q4_K_M": {"default": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "embd": T.Q4_K},
    "Q5_K_M": {"default": T.Q5_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "embd": T.Q5_K},
    "Q6_K": {"default": T.Q6_K},
    "Q8_0": {"default": T.Q8_0},
}
# The tensors' types per quantization as llama.cpp writes them (Q4_K_M: Q6_K for attn_v, ffn_down, output).
QUANTIZATIONS = tuple(MIXES)


# -- Gemma 3 as its GGUFs are: a SentencePiece vocabulary, Gemma's chat template, 1 + weight in every norm,
# and (Ollama's 4B and up) the vision tower and its projector in the same file --------------------------

GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁h", "hi", "▁hi", "th", "▁th", "er", "ere", "▁there", "▁the"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_LAYERS = 6  # one global layer after five sliding ones: Gemma 3's pattern


def write_gemma3(path, mix, *, vision=False, norm_shift=None, rope_factor=None, hidden=256, heads=4, kv=2):
    """A small Gemma 3 GGUF as llama.cpp writes one: `norm_shift` (per head-dim element) is the trained
    q/k norm weight, written as 1 + it; `vision` adds a vision tower (`v.*`) and projector (`mm.*`)."""
    rng = np.random.default_rng(1)
    head_dim, ff = hidden // heads, 2 * hidden
    tokens = [*GEMMA_SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *GEMMA_PIECES]
    w = GGUFWriter(str(path), "gemma3")
    w.add_name("tiny gemma3")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(GEMMA_LAYERS)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(512)
    if rope_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_factor)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * (len(GEMMA_SPECIAL) + 256) + [-float(i) for i in range(len(GEMMA_PIECES))])
    w.add_token_types([3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(GEMMA_PIECES))
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_TEMPLATE)
    vocab = len(tokens)
    shift = np.zeros(head_dim, dtype=np.float32) if norm_shift is None else np.asarray(norm_shift, dtype=np.float32)

    def t(name, rows, cols, kind):
        q = mix.get(kind, mix["default"])
        data = qbytes(rng, q, rows, cols)
        w.add_tensor(name, data) if q in (T.F32, T.F16) else w.add_tensor(name, data, raw_dtype=q)

    def norm(name, values):  # llama.cpp writes Gemma 3's norm weights as 1 + weight
        w.add_tensor(name, (1.0 + values).astype(np.float32))

    t("token_embd.weight", vocab, hidden, "embd")
    norm("output_norm.weight", np.zeros(hidden, dtype=np.float32))
    for i in range(GEMMA_LAYERS):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(p + f"{n}.weight", np.zeros(hidden, dtype=np.float32))
        t(p + "attn_q.weight", heads * head_dim, hidden, "default")
        t(p + "attn_k.weight", kv * head_dim, hidden, "default")
        t(p + "attn_v.weight", kv * head_dim, hidden, "attn_v")
        t(p + "attn_output.weight", hidden, heads * head_dim, "default")
        norm(p + "attn_q_norm.weight", shift)
        norm(p + "attn_k_norm.weight", shift)
        t(p + "ffn_gate.weight", ff, hidden, "default")
        t(p + "ffn_up.weight", ff, hidden, "default")
        t(p + "ffn_down.weight", hidden, ff, "ffn_down")
    if vision:  # Ollama's files carry the tower inline: a few of its tensors stand for all of them
        for name, shape in (
            ("v.patch_embd.weight", (64, 48)),
            ("v.blk.0.attn_q.weight", (64, 64)),
            ("v.post_layernorm.weight", (64,)),
            ("mm.mm_input_projection.weight", (hidden, 64)),
            ("mm.mm_soft_emb_norm.weight", (64,)),
        ):
            w.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
