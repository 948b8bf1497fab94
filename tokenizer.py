"""The tokenizer side of a Qwen2 / Qwen2.5 checkpoint: tokenizer.json through `tokenizers`, the
chat template of tokenizer_config.json, and the special tokens.

A checkpoint folder holds tokenizer.json (byte-level BPE) and tokenizer_config.json, whose
`chat_template` (Jinja) renders a conversation. This project renders one case, one user message
and the generation prompt, so instead of a Jinja engine it reads the template's default system
message from the template's text and writes the ChatML string itself:
    <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n
(Qwen2.5: "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."; Qwen2 and the
toy backbone: "You are a helpful assistant."); a template of another shape is a clear error.
Generation ends at <|im_end|> (chat) or <|endoftext|> (base models).

Left out: a Jinja engine (multi-turn, tool and system-message templates), added tokens beyond
Qwen's three chat tokens for trained tokenizers, slow (Python) tokenizers.

    python tokenizer.py CHECKPOINT_DIR "Who wrote Hamlet?"     # the rendered prompt and its ids
"""

import json
import os
import re
import sys

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's ids 151643-151645

# Qwen2's chat template (Jinja, as Hugging Face folders store it in tokenizer_config.json): the one
# that tokenizers trained here (the toy backbone's) carry. Real checkpoints bring their own.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the Jinja string literal that opens the conversation with a default system message
_DEFAULT_SYSTEM = re.compile(r"""'<\|im_start\|>system\\n((?:[^'\\]|\\.)*?)<\|im_end\|>\\n'""")


def default_system_message(template, source):
    """The system message a ChatML chat template (Qwen2, Qwen2.5) puts first when the conversation
    has none, found in the template's text; `source` names the file in errors. With it, the one
    case this project renders (one user message, the generation prompt) needs no Jinja."""
    found = {m.group(1) for m in _DEFAULT_SYSTEM.finditer(template)}
    if len(found) != 1 or "'<|im_start|>assistant\\n'" not in template or "content" not in template:
        raise ValueError(f"{source}: chat_template is not a ChatML template with one default system message "
                         f"(found {sorted(found)}); rendering it needs Jinja, which this project leaves out")
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), found.pop())  # Jinja escapes


class Tokenizer:
    """tokenizer.json through `tokenizers`, and the chat template of tokenizer_config.json beside
    it (or `chat_template`, given); no special tokens are added implicitly."""

    def __init__(self, path, chat_template=None):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.tok = _HFTokenizer.from_file(path)
        self.path = path
        # generation ends at <|im_end|> (chat) or <|endoftext|> (base models)
        self.eos_ids = [i for i in (self.tok.token_to_id("<|im_end|>"), self.tok.token_to_id("<|endoftext|>"))
                        if i is not None]
        self.pad_id = self.eos_ids[-1] if self.eos_ids else 0
        source = "chat_template argument"
        if chat_template is None:
            source = os.path.join(os.path.dirname(path), "tokenizer_config.json")
            if not os.path.isfile(source):
                raise FileNotFoundError(f"{source} not found: it holds the chat template (every Hugging Face "
                                        "Qwen2.5 folder has one; or pass chat_template=)")
            with open(source) as f:
                try:
                    chat_template = json.load(f).get("chat_template")
                except (json.JSONDecodeError, AttributeError) as e:
                    raise ValueError(f"{source}: not a JSON object ({e})") from None
            if not isinstance(chat_template, str):
                raise ValueError(f"{source}: no chat_template string")
        self.chat_template = chat_template
        self.system = default_system_message(chat_template, source)

    def chat_prompt(self, message):
        """The checkpoint's chat template rendered for one user message with the generation prompt
        (what transformers' apply_chat_template gives for [{"role": "user", "content": message}])."""
        return (f"<|im_start|>system\n{self.system}<|im_end|>\n<|im_start|>user\n{message}<|im_end|>\n"
                "<|im_start|>assistant\n")

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path):
        """Write tokenizer.json to `path` and tokenizer_config.json (with the chat template) beside it."""
        self.tok.save(path)
        config = dict(tokenizer_class="PreTrainedTokenizerFast", chat_template=self.chat_template,
                      eos_token="<|im_end|>", pad_token="<|endoftext|>", add_bos_token=False,
                      model_max_length=32768, clean_up_tokenization_spaces=False)
        with open(os.path.join(os.path.dirname(path), "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)

    @staticmethod
    def train(texts, vocab_size, path, chat_template=QWEN2_CHAT_TEMPLATE):
        """Train a byte-level BPE tokenizer (Qwen's kind) with the chat tokens; write tokenizer.json
        and tokenizer_config.json with `chat_template` beside it."""
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        tokenizer = object.__new__(Tokenizer)
        tokenizer.tok, tokenizer.chat_template = tok, chat_template
        tokenizer.save(path)
        return Tokenizer(path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tokenizer.py CHECKPOINT_DIR MESSAGE")
    tok = Tokenizer(os.path.join(sys.argv[1], "tokenizer.json"))
    prompt = tok.chat_prompt(sys.argv[2])
    print(prompt)
    print(tok.encode(prompt))
