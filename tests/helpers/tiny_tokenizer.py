"""A real byte-level tokenizer built in-process (256 byte symbols + ChatML specials), so
template and engine tests need no download and no 6 s GGUF parse."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# SmolLM2-Instruct's template: ChatML without any notion of tools.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The shape of Qwen2.5's template: tools in the system turn, tool calls as <tool_call>
# JSON, tool results as <tool_response> in a user turn.
QWEN_LIKE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' or (m['role'] == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(chat_template: str | None = SMOL_TEMPLATE) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
