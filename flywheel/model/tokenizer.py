"""The base model's tokenizer: byte-level BPE trained on the project's own corpus.

Digits are split one per token before BPE runs, so numbers keep a regular structure.
Role markers and end-of-turn are special tokens; the Jinja chat template renders

    <|bos|><|system|>...<|eot|><|user|>...<|eot|><|assistant|>...<|eot|><|tool|>...<|eot|>

and, with ``add_generation_prompt``, ends in ``<|assistant|>``. ``<|eot|>`` is the eos
token, so generation (transformers or vLLM) stops at the end of one assistant turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS, EOT, PAD = "<|bos|>", "<|eot|>", "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS = (PAD, BOS, EOT, *ROLE_TOKENS)
"""In id order: pad is 0, bos 1, eot 2, then the role markers."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eot|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int = 256) -> PreTrainedTokenizerFast:
    """Train the BPE on ``texts`` and wrap it with special tokens and the chat template.

    ``max_length`` is the tokenizer's ``model_max_length``: the model's positions (a task's ``max_positions``).
    """
    # lazy: flywheel.model.build imports this module, and serving imports build without training
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
