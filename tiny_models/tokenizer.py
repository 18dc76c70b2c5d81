"""A byte-level BPE tokenizer trained offline on the English corpus shipped with this package."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 1000  # including special tokens
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, PAD)  # ids 0..3, in this order

# ChatML, as Qwen's templates write it; content may be a string or a list of text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}{{- part['text'] -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    endoftext: int

    def as_dict(self) -> dict[str, int]:
        return {"bos": self.bos, "eos": self.eos, "pad": self.pad, "endoftext": self.endoftext}


SPECIAL_IDS = SpecialIds(
    bos=SPECIAL_TOKENS.index(ENDOFTEXT),
    eos=SPECIAL_TOKENS.index(IM_END),
    pad=SPECIAL_TOKENS.index(PAD),
    endoftext=SPECIAL_TOKENS.index(ENDOFTEXT),
)


def corpus_text() -> str:
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def corpus_sha256() -> str:
    return hashlib.sha256(corpus_text().encode()).hexdigest()


def train() -> Tokenizer:
    """Train the BPE on the shipped corpus; the result is the same on every run."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    for token in SPECIAL_TOKENS:
        assert tok.token_to_id(token) == SPECIAL_TOKENS.index(token), token
    return tok


def unprintable_ids(tok: Tokenizer) -> list[int]:
    """Ids that decode to anything but printable ASCII and newlines (control bytes, partial UTF-8)."""
    return [
        i for i in range(tok.get_vocab_size())
        if not all(c == "\n" or " " <= c <= "~" for c in tok.decode([i], skip_special_tokens=False))
    ]


def files(tok: Tokenizer, model_max_length: int) -> dict[str, str]:
    """{file name: text} for tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    special_map = {"bos_token": ENDOFTEXT, "eos_token": IM_END, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n",
    }
