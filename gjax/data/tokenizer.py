"""A tiny character-level tokenizer for the embedded task, built with ``tokenizers``.

Vocabulary (102 ids, fixed order so ids are stable across builds; characters are stored in
the byte-level alphabet, " " as "Ġ" and "\\n" as "Ċ", so Qwen2Tokenizer loads it unchanged)::

    0 <|pad|>   1 <|endoftext|> (eos)   2 <|im_start|>   3 <|im_end|>   4 <|unk|>
    5 "\\n"   6..100 printable ASCII " " .. "~"   101 "\\boxed{" (one token)

Every printable ASCII character is its own token, so any English prompt template (the
papers' Qwen or R1 prompts) round-trips; other characters map to ``<|unk|>``. ``\\boxed{``
is a single added token because every demonstration ends with it. The chat template is
ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), as in Qwen2.

``build_tokenizer(tools=True)`` is the tool-using policy's (scripts/make_tiny_tool_policy.py):
four more added tokens, ``102 <tool_call>  103 </tool_call>  104 <tool_response>
105 </tool_response>`` (Qwen2.5's vocabulary has them as added, non-special tokens too, so a
decoded turn keeps them and gjax.envs.tool_calls parses it), and `TOOL_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported on use: it is slow to import
    from transformers import PreTrainedTokenizerFast

PAD, EOS, IM_START, IM_END, UNK = (
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|unk|>",
)
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))
MULTI_CHAR_TOKENS = ("\\boxed{",)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with Qwen2.5's tool turns, its `# Tools` block replaced by one line the tiny policy
# can afford in its 256 positions ("tools: calculator(expression)": its system turn is 39
# tokens, gjax's `# Tools` block ~760): with `tools`, that line is the system turn (after the system message's text, if any);
# an assistant message's `tool_calls` follow its text as `<tool_call>\n{json}\n</tool_call>`;
# consecutive `tool` messages share one user turn of `\n<tool_response>\n...\n</tool_response>`
# parts, as gjax.envs.tool_calls.tool_turn writes them.
TOOL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\n' }}{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- 'tools:' }}"
    "{%- for t in tools %}"
    "{{- ' ' + t['function']['name'] + '(' + (t['function']['parameters']['properties'] | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages[ns.first:] %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{%- set f = c['function'] if 'function' in c else c %}"
    "{%- if loop.first and m['content'] %}{{- '\n' }}{%- endif %}"
    "{%- if not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{- f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(
    model_max_length: int = 4096, *, tools: bool = False
) -> PreTrainedTokenizerFast:
    """The task tokenizer as a ``PreTrainedTokenizerFast`` (vocab size 102; with `tools`, the
    tool-using policy's: 106 ids and `TOOL_CHAT_TEMPLATE`).

    >>> tok = build_tokenizer()
    >>> tok.decode(tok("7+5=12")["input_ids"])
    '7+5=12'
    """
    from transformers import PreTrainedTokenizerFast  # slow to import: on use

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    byte_char = _bytes_to_unicode()
    for ch in CHARACTERS:
        vocab[byte_char[ord(ch)]] = len(vocab)
    # BPE without merges over the byte-level alphabet (" " is "Ġ", "\n" is "Ċ", as in Qwen2's
    # tokenizer): a character-level model that transformers' Qwen2Tokenizer, which
    # AutoTokenizer picks for a qwen2 checkpoint, loads with the same ids.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    added = MULTI_CHAR_TOKENS + (TOOL_TOKENS if tools else ())
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    expected = len(SPECIAL_TOKENS) + len(CHARACTERS) + len(added)
    if len(tok) != expected:  # A tokenizers change that merged or dropped ids: fail loudly.
        raise RuntimeError(f"tokenizer has {len(tok)} ids, expected {expected}")
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, directory: str) -> list[str]:
    """``save_pretrained`` plus ``special_tokens_map.json`` (transformers 5 no longer writes it).

    Returns the paths written.
    """
    paths = list(tok.save_pretrained(directory))
    special = {
        "pad_token": tok.pad_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "additional_special_tokens": [IM_START, IM_END],
    }
    path = os.path.join(directory, "special_tokens_map.json")
    with open(path, "w") as f:
        json.dump(special, f, indent=2)
    if path not in paths:
        paths.append(path)
    return paths
