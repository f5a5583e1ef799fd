"""Tiny model directories for a real inference engine, built locally (no download).

Each builder writes into a directory the caller gives (a test's temporary directory) and
returns its path. The engine loads them with ``--load-format dummy`` (random weights): what
the real-engine tier checks is the plumbing (ids, logprobs, finish reasons, vision token
counts), which needs real shapes, not meaningful weights.

- :func:`build_tokenizer`: a byte-level BPE ``tokenizer.json`` trained here with
  ``tokenizers`` on a small fixed text, carrying Qwen2.5's added tokens (ChatML, tool-call and
  vision tokens), and a ``tokenizer_config.json`` with Qwen2.5's own chat template (tools,
  tool calls, tool responses). Its size is the model's ``vocab_size``: the engine can only
  sample ids the tokenizer can decode.
- :func:`build_qwen2`: a tiny ``Qwen2ForCausalLM`` (hidden 256, 4 heads, 2 KV heads, head_dim 64
  -- the smallest the CPU attention takes -- 2 layers, bf16).
- :func:`build_qwen3_moe`: a tiny ``Qwen3MoeForCausalLM`` (8 experts, top-2).
- :func:`build_qwen2_vl`: a tiny ``Qwen2VLForConditionalGeneration`` with Qwen2-VL's chat
  template (image parts) and the ``preprocessor_config.json`` its image processor reads.
- :func:`build_other_vocab_tokenizer`: a tokenizer whose vocabulary differs from the models'
  (a start-up check must refuse it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.webapp.conftest import QWEN2_VL_TEMPLATE  # Qwen2-VL's own template (image parts)

__all__ = [
    "QWEN25_TEMPLATE",
    "SPECIAL_TOKENS",
    "VL_PREPROCESSOR",
    "build_other_vocab_tokenizer",
    "build_qwen2",
    "build_qwen2_vl",
    "build_qwen3_moe",
    "build_tokenizer",
]

# Qwen2.5-Instruct's added tokens: the special ones (ChatML, vision) and the tool-call tags,
# which Qwen ships as added but not special (they may appear in text and are parsed from it).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TARGET_VOCAB = 1024

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# Qwen2-VL's image processor settings (its preprocessor_config.json), max_pixels lowered so a
# screenshot stays a few hundred tokens on a CPU engine.
VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True,
                   "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                   "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}

_WORDS = ["the", "agent", "clicks", "button", "screen", "types", "hello", "world", "open", "file", "terminal", "browser", "page", "search", "result", "scroll", "down", "up", "left", "right", "window", "close", "save", "edit", "copy", "paste", "select", "text", "input", "field", "submit", "form", "wait", "load", "image", "screenshot", "mouse", "keyboard", "press", "enter", "tab", "shift", "control", "move", "drag", "drop", "menu", "item", "settings", "list", "table", "row", "column", "cell", "value", "name", "arguments", "function", "call", "tool", "response", "error", "success", "true", "false", "null", "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "x", "y", "width", "height", "click_at", "type_text", "get_weather", "city", "weather", "sunny", "cloudy", "rain", "degrees"]


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _corpus(seed_words: tuple[str, ...] | list[str], lines: int = 400) -> list[str]:
    """A fixed, varied text (sentences, JSON tool calls, numbers, made-up words) so BPE learns
    enough merges for a ~1000-id vocabulary."""
    n_syl = len(_SYLLABLES)
    out = [" ".join(_SYLLABLES[(i * 7 + j * 13) % n_syl] + _SYLLABLES[(i * 3 + j) % n_syl] for j in range(12))
           for i in range(lines)]
    n = len(seed_words)
    for i in range(lines):
        a, b, c, d = (seed_words[(i * k + k) % n] for k in (1, 3, 7, 11))
        out.append(f"{a} {b} {c}, {d} {i} {i * 37 % 1000}.")
        out.append(json.dumps({"name": a, "arguments": {b: c, "n": i, d: [i % 7, i % 13]}}))
        out.append(f"<tool_call>\n{{\"name\": \"{c}\", \"arguments\": {{\"{a}\": {i}}}}}\n</tool_call>")
    return out


# Qwen2's split (transformers/models/qwen2/tokenization_qwen2.py). The pipeline must be Qwen2's
# own: transformers 5 (and so vLLM) builds Qwen2Tokenizer's normalizer and pre-tokenizer itself
# and keeps only the vocabulary and merges of tokenizer.json, while our adapter runs the
# tokenizer.json as written: another pre-tokenizer there (GPT-2's, which keeps digit runs
# together) makes the two tokenize alike text differently.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _train(corpus: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TOOL_TOKENS), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def build_tokenizer(path: Path, *, corpus_words: tuple[str, ...] | list[str] = _WORDS,
                    vocab_size: int = TARGET_VOCAB, chat_template: str = QWEN25_TEMPLATE) -> int:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``path``; returns the vocabulary size."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _train(_corpus(corpus_words), vocab_size)
    tok.save(str(path / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added, "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "split_special_tokens": False, "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def build_other_vocab_tokenizer(path: Path) -> int:
    """Same layout, another vocabulary (other text, smaller size): a tokenizer that does not
    belong to the served model."""
    return build_tokenizer(path, corpus_words=[w[::-1] + "q" for w in _WORDS], vocab_size=700)


def _ids(path: Path) -> dict[str, int]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)}


def _write_model(path: Path, config: dict[str, Any], chat_template: str = QWEN25_TEMPLATE) -> Path:
    vocab = build_tokenizer(path, chat_template=chat_template)
    ids = _ids(path)
    config = {"vocab_size": vocab, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
              "torch_dtype": "bfloat16", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
              "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0, **config}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
         "pad_token_id": ids["<|endoftext|>"]}))
    return path


_DENSE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "head_dim": 64}


def build_qwen2(path: Path) -> Path:
    return _write_model(path, {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_DENSE,
                               "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2})


MOE_EXPERTS, MOE_TOP_K, MOE_LAYERS = 8, 2, 2


def build_qwen3_moe(path: Path) -> Path:
    return _write_model(path, {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_DENSE,
        "num_hidden_layers": MOE_LAYERS, "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
        "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "attention_bias": False, "output_router_logits": False, "router_aux_loss_coef": 0.001})


def build_qwen2_vl(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR, indent=1))
    built = _write_model(path, {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", **_DENSE,
        # mrope sections add up to head_dim / 2.
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "vision_config": {"depth": 2, "embed_dim": 64, "hidden_size": 256, "hidden_act": "quick_gelu",
                          "mlp_ratio": 2, "num_heads": 4, "in_chans": 3, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2}},
        chat_template=QWEN2_VL_TEMPLATE)
    ids = _ids(path)
    config = json.loads((path / "config.json").read_text())
    config.update({"vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                   "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
                   "video_token_id": ids["<|video_pad|>"]})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return built
